"""The persistent program cache is keyed by the captured program: code a step reaches through
a submodule attribute (``pkg.sub.f``) or an import in its body, an installed library upgraded,
an Enum member's value, a numpy array's bytes and a generator's seed all change what the trace
records. Each test compiles a step, changes what it reaches as a restarted process would see it
(modules imported afresh from edited files), and checks that a new step object compiles afresh
and computes what the changed step computes eagerly, not the cached program's old numbers; the
same program captured again is loaded.
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _compare import assert_trees_equal
from _dist import Job, script_env

import fddp

LOADED = "loaded from cache"
W, X = torch.ones(3, dtype=torch.float64), torch.linspace(-1.0, 1.0, 15).double().reshape(5, 3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "programs"
    monkeypatch.setattr(fddp._compiler._cache._persistent, "_directory", str(directory))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edit of equal size and second
    return directory


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write modules under a directory on ``sys.path`` and import them afresh, as a restarted
    process does; they leave ``sys.modules`` after the test."""
    root = tmp_path / "code"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    written: set[str] = set()

    def write(files: dict[str, str]) -> None:
        for name, text in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
            written.add(name.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
        for name in written:
            sys.modules.pop(name, None)
        importlib.invalidate_caches()

    yield write
    for name in written:
        sys.modules.pop(name, None)


def _step(source: str, **globals_):
    namespace = {"fddp": fddp, "torch": torch, "__name__": "the_script", **globals_}
    exec(compile(textwrap.dedent(source), "<script>", "exec"), namespace)
    return namespace["step"]


def _run(step):
    """A new step object's result and how its program was made."""
    pstep = fddp.data_parallel(step)
    return pstep(W, X), pstep.schedule(W, X).captured_with


def _compiles_afresh(make_step) -> None:
    """``make_step()`` (called after each change) is cached, then loaded, then, changed, compiled
    afresh with the changed numbers."""
    before, how = _run(make_step(2.0))
    assert how == "make_fx"
    assert _run(make_step(2.0))[1].endswith(LOADED)
    changed = make_step(3.0)
    out, how = _run(changed)
    assert how == "make_fx"
    assert_trees_equal(out, changed(W, X))
    assert not torch.equal(out, before)


_USES_SUB = """
def step(w, x):
    g = fddp.grad(lambda w: pkg.sub.f(x @ w).pow(2).mean())(w)
    return w - 0.1 * fddp.pmean(g)
"""


def test_an_edited_submodule_reached_as_an_attribute(cache, modules):
    def make(scale: float):
        modules({"pkg/__init__.py": "", "pkg/sub.py": f"def f(h):\n    return h * {scale}\n"})
        importlib.import_module("pkg.sub")
        return _step(_USES_SUB, pkg=importlib.import_module("pkg"))

    _compiles_afresh(make)


_IMPORTS_IN_BODY = """
def step(w, x):
    import inner_helper
    import inner_pkg.inner_sub
    from inner_lib import inner_mod

    def loss(w):
        h = inner_pkg.inner_sub.g(inner_helper.f(x @ w))
        return inner_mod.k(inner_pkg.h(h)).pow(2).mean()

    return w - 0.1 * fddp.pmean(fddp.grad(loss)(w))
"""
_IMPORTED = {
    "inner_helper.py": "def f(h):\n    return h * {c}\n",
    "inner_pkg/__init__.py": "def h(x):\n    return x - {c}\n",
    "inner_pkg/inner_sub.py": "def g(h):\n    return h + {c}\n",
    "inner_lib/__init__.py": "",
    "inner_lib/inner_mod.py": "def k(h):\n    return h / {c}\n",
}


@pytest.mark.parametrize("edited", [name for name, text in _IMPORTED.items() if text])
def test_an_edited_module_imported_in_the_step_body(cache, modules, edited):
    def make(scale: float):
        modules(  # not imported until the step (or the cache's key) imports them
            {
                name: text.format(c=scale if name == edited else 2.0)
                for name, text in _IMPORTED.items()
            }
        )
        return _step(_IMPORTS_IN_BODY)

    _compiles_afresh(make)


_USES_ENUM = """
import enum

class Scale(enum.Enum):
    A = {scale}

SCALE = Scale.A

def step(w, x):
    g = fddp.grad(lambda w: ((x @ w) * SCALE.value).pow(2).mean())(w)
    return w - 0.1 * fddp.pmean(g)
"""


def test_an_edited_enum_value(cache):
    _compiles_afresh(lambda scale: _step(_USES_ENUM.format(scale=scale)))


_USES_ARRAY = """
def step(w, x):
    a, b = (float(v) for v in TABLE[1000:1002])
    g = fddp.grad(lambda w: ((x @ w) * a + b).pow(2).mean())(w)
    return w - 0.1 * fddp.pmean(g)
"""


@pytest.mark.parametrize("where", ["elided by repr", "9th digit"])
def test_a_changed_numpy_array(cache, where):
    def make(scale: float):
        table = np.full(2000, 0.123456789)
        if scale != 2.0:
            table[1000:1002] = 0.123456788 if where == "9th digit" else 0.5
        return _step(_USES_ARRAY, TABLE=table)

    if where == "9th digit":  # repr shows 8 digits
        assert repr(np.array([0.123456789])) == repr(np.array([0.123456788]))
    else:
        assert "..." in repr(np.full(2000, 0.123456789))
    _compiles_afresh(make)


# --- an installed library upgraded, in new processes -------------------------------------------

_SCRIPT = """
import json, sys
sys.path.append(sys.argv[2])  # the site directory, as PYTHONPATH would put it
sys.dont_write_bytecode = True  # an edit of equal size and second: no stale .pyc
import torch
import fddp
import fakelib

fddp.set_cache_dir(sys.argv[1])
w, x = torch.ones(3), torch.linspace(-1.0, 1.0, 15).reshape(5, 3)

def step(w, x):
    g = fddp.grad(lambda w: fakelib.f(x @ w).pow(2).mean())(w)
    return w - 0.1 * fddp.pmean(g)

pstep = fddp.data_parallel(step)
out = pstep(w, x)
print(json.dumps({
    "how": pstep.schedule(w, x).captured_with,
    "out": out.tolist(),
    "eager": step(w, x).tolist(),
}))
"""


def _install(site: Path, dist: str, version: str, scale: float) -> None:
    """``fakelib`` as distribution ``dist`` ``version`` in ``site``: a package and metadata
    that names its top-level module in ``top_level.txt`` (when ``dist`` is the module's name)
    or only in its file list."""
    for old in site.glob("*.dist-info"):
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    (site / "fakelib").mkdir(parents=True, exist_ok=True)
    (site / "fakelib" / "__init__.py").write_text(f"def f(h):\n    return h * {scale}\n")
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    if dist == "fakelib":
        (info / "top_level.txt").write_text("fakelib\n")
    else:
        (info / "RECORD").write_text(f"fakelib/__init__.py,,\n{info.name}/METADATA,,\n")


@pytest.mark.parametrize("dist", ["fakelib", "fake-distribution"])
def test_an_upgraded_installed_library(tmp_path, dist):
    site = tmp_path / "lib" / "site-packages"  # where installed code lives: keyed by version
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = script_env(PYTHONDONTWRITEBYTECODE="1")
    runs = itertools.count()

    def run() -> dict:
        """The script in a new process, forked from the fork server (which has imported torch
        and fddp, and nothing of fakelib), as a restarted process would run it."""
        command = [sys.executable, str(script), str(tmp_path / "programs"), str(site)]
        job = Job(f"run{next(runs)}", [(command, env)], tmp_path, 300, forked=True).wait()
        output = job.output(0)
        assert job.returncodes() == [0], output[-6000:]
        return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])

    _install(site, dist, "1.0", 2.0)
    first = run()
    assert first["how"] == "make_fx"
    assert run()["how"].endswith(LOADED)
    _install(site, dist, "2.0", 3.0)
    upgraded = run()
    assert upgraded["how"] == "make_fx"
    assert upgraded["out"] == upgraded["eager"] != first["out"]
    _install(site, dist, "2.1", 3.0)  # the version alone: the same captured program
    again = run()
    assert again["how"].endswith(LOADED)
    assert again["out"] == again["eager"] == upgraded["out"]


def test_state_no_reading_of_source_sees_is_in_the_captured_program(cache):
    """A generator's seed, read while the step is traced, is a number in the captured graph:
    another seed is another program, and the same seed loads the first one."""
    generator = torch.Generator()

    def step(w, x):
        scale = float(generator.initial_seed())
        g = fddp.grad(lambda w: ((x @ w) * scale).pow(2).mean())(w)
        return w - 0.01 * fddp.pmean(g)

    generator.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before, how = _run(step)
        assert how == "make_fx"
        assert _run(step)[1].endswith(LOADED)
        generator.manual_seed(3)
        out, how = _run(step)
    assert how == "make_fx"
    assert_trees_equal(out, step(W, X))
    assert not torch.equal(out, before)
