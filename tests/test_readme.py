"""README's quickstart runs as written on 2 ranks, and without its pmean line it is an error."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from _dist import run_checks

README = Path(__file__).resolve().parents[1] / "README.md"
PMEAN_LINE = "    grads = fddp.pmean(grads)"


def quickstart() -> str:
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(code: str) -> dict:
    import contextlib
    import io

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "quickstart.py", "exec"), {"__name__": "__main__"})
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "printed": printed.getvalue()}
    return {"printed": printed.getvalue()}


@pytest.fixture(scope="module")
def runs():
    code = quickstart()
    assert PMEAN_LINE in code
    forgotten = code.replace(PMEAN_LINE, "")
    checks = {
        "quickstart": functools.partial(_run, code),
        "forgotten": functools.partial(_run, forgotten),
    }
    return run_checks(checks, 2, timeout=180)


def test_quickstart_trains_on_two_ranks(runs):
    ranks = runs["quickstart"]
    for out in ranks:
        assert "error" not in out, out
        assert re.search(r"loss \d+\.\d+", out["printed"]), out["printed"]
        assert "bucketed all-reduce" in out["printed"] and "replicated" in out["printed"]
    assert ranks[0]["printed"].split("\n")[0] == ranks[1]["printed"].split("\n")[0]  # same loss


def test_quickstart_without_its_pmean_line_is_an_error(runs):
    for out in runs["forgotten"]:
        assert out.get("error") == "ReplicaMismatchError", out
        assert "fddp.pmean(grads)" in out["message"]
