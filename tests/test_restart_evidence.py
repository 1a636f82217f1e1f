"""A restarted job with the program cache on (``fddp.set_cache_dir``) computes what its step
computes eagerly, whatever changed between the two runs in code or values the step reaches in
ways no reading of its source can follow: a user module named like a standard-library module
(``trace.py``, a ``code/`` package), code reached by name at run time (``importlib``,
``getattr`` over a re-export), classes kept in a set or as dict keys, numbers read from a tensor
with ``tolist()`` while tracing, and a package installed in site-packages edited without a new
version. A step that draws from a Python ``random.Random`` while it is traced gets an error that
says why, instead of one draw frozen into the program. Unchanged, a restart still loads.

Each run is a new process (forked from the test's fork server) running a user's script over a
project directory; the project is edited between runs as a user would edit it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _dist import Job, script_env

LOADED = "loaded from cache"

_SCRIPT = r"""
import importlib, json, random, sys
project, site, cache = sys.argv[1:4]
sys.path[:0] = [project]
sys.path.append(site)  # as PYTHONPATH would put an installed package's site directory
sys.dont_write_bytecode = True  # an edit of equal size within a second: no stale .pyc
for name in ("trace", "code"):
    sys.modules.pop(name, None)  # the user's own, as in a fresh interpreter started in project
import torch
import fddp
import trace, code, reexport, acts, editpkg

fddp.set_cache_dir(cache)
w, x = torch.ones(3), torch.linspace(-1.0, 1.0, 15).reshape(5, 3)
NAME = "f"
CLASSES = {acts.Gain}
WEIGHTS = {acts.Gain: 1.0}
STATS = torch.load(project + "/stats.pt")
RNG = random.Random(int(open(project + "/seed.txt").read()))


def sgd(f):
    def step(w, x):
        g = fddp.grad(lambda w: f(x @ w).pow(2).mean())(w)
        return w - 0.1 * fddp.pmean(g)
    return step


def from_set(h):
    for cls in CLASSES:
        h = h * cls.VALUE
    return h


def from_keys(h):
    return sum(cls.VALUE * h * weight for cls, weight in WEIGHTS.items())


def from_tolist(h):
    a, b = STATS.tolist()
    return h * a + b


def from_generator(h):
    return h * RNG.random()


STEPS = {
    "a module named like a standard-library module": sgd(lambda h: trace.f(h)),
    "a package named like a standard-library module": sgd(lambda h: code.f(h)),
    "code imported by name": sgd(lambda h: importlib.import_module("dyn_target").f(h)),
    "getattr over a re-export": sgd(lambda h: getattr(reexport, NAME)(h)),
    "classes in a set": sgd(from_set),
    "classes as dict keys": sgd(from_keys),
    "numbers from tolist()": sgd(from_tolist),
    "an installed package edited": sgd(lambda h: editpkg.f(h)),
    "a random.Random instance": sgd(from_generator),
}
results = {}
for case, step in STEPS.items():
    pstep = fddp.data_parallel(step)
    state = RNG.getstate()
    try:
        out = pstep(w, x)
    except fddp.CaptureError as e:
        results[case] = {"error": str(e)}
        continue
    RNG.setstate(state)
    results[case] = {
        "how": pstep.schedule(w, x).captured_with,
        "out": out.tolist(),
        "eager": step(w, x).tolist(),
    }
print(json.dumps(results))
"""


def _write_project(root: Path, site: Path, c: float) -> None:
    """The user's project with every constant the step reaches set to ``c``."""
    files = {
        "trace.py": f"SCALE = {c}\n\ndef f(h):\n    return h * SCALE\n",
        "code/__init__.py": f"def f(h):\n    return h + {c}\n",
        "dyn_target.py": f"def f(h):\n    return h * {c}\n",
        "reexport/__init__.py": "from .impl import f\n",
        "reexport/impl.py": f"def f(h):\n    return h - {c}\n",
        "acts.py": f"class Gain:\n    VALUE = {c}\n",
        "seed.txt": str(int(c)),
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    torch.save(torch.tensor([c, 1.0]), root / "stats.pt")
    package = site / "editpkg"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(f"def f(h):\n    return h * {c} + 1.0\n")
    info = site / "editpkg-1.0.dist-info"  # edited in place: the version stays
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: editpkg\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("editpkg\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """The script's results in three new processes: the project as first written, then
    edited, then unchanged."""
    tmp = tmp_path_factory.mktemp("restart")
    project, site = tmp / "project", tmp / "lib" / "site-packages"
    script = tmp / "train.py"
    script.write_text(_SCRIPT)
    env = script_env(PYTHONDONTWRITEBYTECODE="1")
    results = []
    for i, c in enumerate((2.0, 3.0, 3.0)):
        _write_project(project, site, c)
        command = [sys.executable, str(script), str(project), str(site), str(tmp / "programs")]
        job = Job(f"run{i}", [(command, env)], tmp, 600, forked=True).wait()
        output = job.output(0)
        assert job.returncodes() == [0], output[-6000:]
        results.append(json.loads([line for line in output.splitlines() if line[:1] == "{"][-1]))
    return results


CASES = [
    "a module named like a standard-library module",
    "a package named like a standard-library module",
    "code imported by name",
    "getattr over a re-export",
    "classes in a set",
    "classes as dict keys",
    "numbers from tolist()",
    "an installed package edited",
]


@pytest.mark.parametrize("case", CASES)
def test_a_restart_after_an_edit_computes_the_edited_step(case, runs):
    first, edited, unchanged = (run[case] for run in runs)
    assert first["out"] == first["eager"]
    assert edited["out"] == edited["eager"] != first["out"]
    assert unchanged["out"] == unchanged["eager"]
    assert unchanged["how"].endswith(LOADED)


def test_a_draw_from_a_python_generator_while_tracing_is_an_error(runs):
    for run in runs:
        error = run["a random.Random instance"].get("error", "")
        assert "random" in error and "from_generator" in error
