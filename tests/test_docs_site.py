"""The documentation site builds with warnings as errors and its pages render in a browser."""

from __future__ import annotations

import html
import html.parser
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import quickstart

import fddp

ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "docs" / "guides" / "ddp_loop.py"
NAMESPACES = ["fddp", "fddp.optim", "fddp.nn", "fddp.data", "fddp.typing", "fddp.remat_policies"]


def _unavailable(reason: str) -> None:
    """Skip here; fail where CI is set, so CI cannot pass by skipping."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this test may not be skipped)")
    pytest.skip(reason)


class _Page(html.parser.HTMLParser):
    """The element ids of a page and the text of each of its <pre> blocks."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.blocks: list[str] = []
        self._depth = 0
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(value for name, value in attrs if name == "id" and value)
        if tag == "pre":
            if self._depth == 0:
                self.blocks.append("")
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "pre" and self._depth:
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._depth:
            self.blocks[-1] += data


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        _unavailable('mkdocs is not installed (pip install -e ".[dev]")')
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return out


def _dom(path: Path, tmp_path: Path, *options: str) -> str:
    """The DOM of the HTML file ``path`` after headless Chromium loaded it."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        _unavailable("chromium is not installed (apt-get install -y chromium)")
    browser = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}",
            *options,
            "--dump-dom",
            path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert browser.returncode == 0 and "</html>" in browser.stdout, browser.stderr[-2000:]
    return browser.stdout


def rendered(site: Path, page: str, tmp_path: Path) -> _Page:
    """The page's DOM after headless Chromium loaded it."""
    path = site / page / "index.html"
    assert path.is_file(), f"the site has no page {page}/"
    return _Page(_dom(path, tmp_path))


# Marks each code block that scrolls sideways with the length of its longest line.
_CLIPPED = """<script>addEventListener("load", () => document.body.dataset.clipped = JSON.stringify(
  [...document.querySelectorAll(".md-typeset pre > code")]
    .filter((code) => code.scrollWidth > code.clientWidth + 1)
    .map((code) => Math.max(...code.textContent.split("\\n").map((line) => line.length)))));
</script></body>"""


def test_quickstart_page_shows_the_readme_quickstart(site: Path, tmp_path: Path) -> None:
    page = rendered(site, "quickstart", tmp_path)
    assert quickstart().strip() in [block.strip() for block in page.blocks]


@pytest.mark.parametrize(
    "page", ["quickstart", "guides/from-ddp", "guides/recovery", "reference/optim"]
)
def test_code_of_100_columns_fits_a_1280_px_window(site: Path, tmp_path: Path, page: str) -> None:
    """Code is written to 100 columns (ruff's line length): in a 1280 px wide window no such
    block is cut at the right edge (only longer lines, printed output, scroll)."""
    probe = site / page / "probe.html"
    probe.write_text((site / page / "index.html").read_text().replace("</body>", _CLIPPED))
    dom = _dom(probe, tmp_path, "--window-size=1280,900", "--virtual-time-budget=5000")
    found = re.search(r'data-clipped="([^"]*)"', dom)
    assert found, "the probe did not run"
    longest = json.loads(html.unescape(found.group(1)))
    assert [n for n in longest if n <= 100] == [], longest


def test_api_page_shows_signatures_and_examples(site: Path, tmp_path: Path) -> None:
    page = rendered(site, "reference/fddp", tmp_path)
    signature = next(b for b in page.blocks if b.lstrip().startswith("data_parallel("))
    shown = re.findall(r"^\s+\**(\w+)\s*[:=,)]", signature, re.M)
    assert shown == list(inspect.signature(fddp.data_parallel).parameters), signature
    examples = [b for b in page.blocks if b.lstrip().startswith(">>> ")]
    assert any("@fddp.data_parallel" in b for b in examples), examples


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_reference_documents_every_public_name(site: Path, namespace: str) -> None:
    module = importlib.import_module(namespace)
    page = _Page((site / "reference" / namespace.split(".")[-1] / "index.html").read_text())
    public = [name for name in module.__all__ if not inspect.ismodule(getattr(module, name, None))]
    missing = [name for name in public if f"{namespace}.{name}" not in page.ids]
    assert public and not missing, f"{namespace}: no entry for {missing}"


def test_fddp_reference_leads_with_the_step_and_ends_with_the_errors(site: Path) -> None:
    """The page follows ``fddp.__all__``, which reads from init and data_parallel to the error
    classes, last."""
    text = (site / "reference" / "fddp" / "index.html").read_text()
    shown = list(dict.fromkeys(re.findall(r'id="fddp\.(\w+)"', text)))
    public = [name for name in fddp.__all__ if not inspect.ismodule(getattr(fddp, name))]
    assert shown == public
    errors = [
        n
        for n in public
        if isinstance(getattr(fddp, n), type) and issubclass(getattr(fddp, n), Exception | Warning)
    ]
    assert public.index("data_parallel") < 10
    assert public[-len(errors) :] == errors


def test_ddp_guide_shows_its_loop(site: Path) -> None:
    page = _Page((site / "guides" / "from-ddp" / "index.html").read_text())
    assert LOOP.read_text().strip() in [block.strip() for block in page.blocks]


def test_readme_links_lead_to_files() -> None:
    """README is the way into the documentation: each of its relative links names a file."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert "docs/reference/fddp.md" in local and "docs/guides/from-ddp.md" in local, local
    assert [link for link in local if not (ROOT / link).exists()] == []


def _run_loop(script: Path, cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # two of these run at once
    return subprocess.Popen(
        [sys.executable, str(script)], cwd=cwd, env=env, stdout=subprocess.PIPE, text=True
    )


def _lines(process: subprocess.Popen[str]) -> list[str]:
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    return out.splitlines()


def test_ddp_guide_loop_resumes_where_it_stopped(tmp_path: Path) -> None:
    """The guide's loop, stopped after two epochs and run again, ends as if never stopped."""
    text = LOOP.read_text()
    loop = "for epoch in range(start, epochs):"
    assert loop in text
    stopping = tmp_path / "stopping.py"
    stopping.write_text(text.replace(loop, "for epoch in range(start, 2):"))
    (tmp_path / "whole").mkdir()
    (tmp_path / "stopped").mkdir()
    whole = _run_loop(LOOP, tmp_path / "whole")
    first = _run_loop(stopping, tmp_path / "stopped")
    whole_lines, first_lines = _lines(whole), _lines(first)
    resumed_lines = _lines(_run_loop(LOOP, tmp_path / "stopped"))
    assert [line.split(":")[0] for line in whole_lines] == ["epoch 0", "epoch 1", "epoch 2"]
    assert first_lines == whole_lines[:2]
    assert resumed_lines == whole_lines[2:]
