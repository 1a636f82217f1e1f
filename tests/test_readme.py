"""README's quickstart runs as written on 2 ranks, and without its pmean line it is an error."""

from __future__ import annotations

import re
from pathlib import Path

from _dist import run_ranks

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


def test_quickstart_trains_on_two_ranks_and_a_forgotten_pmean_is_an_error():
    code = quickstart()
    assert PMEAN_LINE in code
    forgotten = code.replace(PMEAN_LINE, "")
    ranks = run_ranks(_run, 2, code, timeout=180)
    for out in ranks:
        assert "error" not in out, out
        assert re.search(r"loss \d+\.\d+", out["printed"]), out["printed"]
        assert "bucketed all-reduce" in out["printed"] and "replicated" in out["printed"]
    assert ranks[0]["printed"].split("\n")[0] == ranks[1]["printed"].split("\n")[0]  # same loss
    for out in run_ranks(_run, 2, forgotten, timeout=180):
        assert out.get("error") == "ReplicaMismatchError", out
        assert "fddp.pmean(grads)" in out["message"]
