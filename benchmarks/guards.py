"""The per-call cost of re-checking what a step's trace read, against the step itself.

Every call of a compiled step first checks that what its capture read (module attributes such
as a dropout's ``p``, hook dictionaries, the block templates' globals and closure variables,
torch's global state) reads the same again. This times that check alone (on the step captured
as ``data_parallel`` captures it, the developer entry point ``capture_step``) and the whole call,
interleaved, on the GPT of ``examples/train_gpt.py`` (its default size: 4 layers, width 128,
sequences of 128, batch 16) and on a deeper stack, in a world of one.

    python benchmarks/guards.py
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fddp
import fddp.optim as optim
from benchmarks.provenance import commit
from examples.train_gpt import GPT, make_step
from fddp._compiler._capture._trace import capture_step

VOCAB = 100  # about the corpus's characters


def measure(layers: int, dim: int, seq: int, batch: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = GPT(VOCAB, seq, dim, layers, heads=4)
    params, buffers = fddp.state(model)
    apply = fddp.functional(model)
    opt = optim.adamw(1e-3)
    step_args = argparse.Namespace(bucket_mb=None, compile=False)
    _, step = make_step(apply, opt, step_args)
    state = opt.init(params)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    guards = capture_step(step.__wrapped__, (params, state, buffers, x, y)).guards
    for _ in range(3):
        params, state, loss = step(params, state, buffers, x, y)
    checks, calls = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        assert guards.check() is None
        checks.append(time.perf_counter() - start)
        start = time.perf_counter()
        params, state, loss = step(params, state, buffers, x, y)
        loss.item()
        calls.append(time.perf_counter() - start)
    return {
        "reads": len(guards.reads),
        "check": statistics.median(checks),
        "call": statistics.median(calls),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    fddp.init()
    torch.set_num_threads(1)
    rows = [
        "| model | reads checked | check per call | call | check / call |",
        "|---|---|---|---|---|",
    ]
    for name, shape in [
        ("examples/train_gpt.py (4 layers, width 128, 16 x 128)", (4, 128, 128, 16)),
        ("32 layers, width 128, 4 x 32", (32, 128, 32, 4)),
    ]:
        found = measure(*shape, repeats=args.repeats)
        rows.append(
            f"| {name} | {found['reads']} | {found['check'] * 1e6:.0f} us | "
            f"{found['call'] * 1e3:.1f} ms | {found['check'] / found['call'] * 100:.2f} % |"
        )
        print(rows[-1], flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    report = Path(args.out) / f"{stamp}_guards.md"
    load = os.getloadavg()
    report.write_text(
        f"# The per-call check of what a trace read (torch {torch.__version__}, "
        f"{os.cpu_count()} cores, load {load[0]:.1f})\n\n"
        f"`python benchmarks/guards.py` at commit {commit()}: medians of {args.repeats} calls, "
        "the check and the call interleaved, one thread, a world of one.\n\n"
        + "\n".join(rows)
        + "\n"
    )
    print(f"wrote {report}")


if __name__ == "__main__":
    main()
