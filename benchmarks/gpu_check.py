"""python benchmarks/gpu_check.py

A GPU check for a task that is lent one for a few minutes (under 5 on one GPU): fddp's CUDA
capture path, ``compile=True``, a world of one against plain eager ``torch.func`` training (fddp's
overhead; the target is at most 2 %), and correctness against one process, in one table. Without
CUDA it prints ``skipped`` and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fddp
import fddp.optim as optim


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10)).cuda()


def _steps(model: torch.nn.Module):
    apply = fddp.functional(model)
    opt = optim.adamw(lr=1e-3, weight_decay=0.01)

    def loss_fn(params, buffers, x, y):
        return F.cross_entropy(apply(params, buffers, x), y)

    def step(params, opt_state, buffers, x, y):
        loss, grads = fddp.value_and_grad(loss_fn)(params, buffers, x, y)
        updates, opt_state = opt.update(fddp.pmean(grads), opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return step, opt


def _time(run, args, steps: int) -> tuple[float, tuple]:
    """Median ms per step of ``run`` fed its own outputs, after two warm-up steps."""
    params, opt_state, buffers, x, y = args
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        params, opt_state, loss = run(params, opt_state, buffers, x, y)
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), (params, opt_state, loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-compile", action="store_true", help="skip compile=True (Inductor)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    fddp.init()
    model = _model(args.width, args.layers)
    params, buffers = fddp.state(model)
    step, opt = _steps(model)
    x = torch.randn(args.batch, args.width, device="cuda")
    y = torch.randint(0, 10, (args.batch,), device="cuda")

    def start() -> tuple:  # fresh copies: a donating variant overwrites its arguments
        fresh = {k: v.clone() for k, v in params.items()}
        return fresh, opt.init(fresh), buffers, x, y

    variants = {"eager torch.func": step, "fddp.data_parallel": fddp.data_parallel(step)}
    variants["fddp donate_argnums=(0, 1)"] = fddp.data_parallel(step, donate_argnums=(0, 1))
    if not args.no_compile:
        variants["fddp compile=True"] = fddp.data_parallel(step, compile=True)
    first_call = {}
    for name, run in variants.items():
        begin = time.perf_counter()
        run(*start())
        torch.cuda.synchronize()
        first_call[name] = time.perf_counter() - begin
    results = {name: _time(run, start(), args.steps) for name, run in variants.items()}
    reference_ms, (reference, _, _) = results["eager torch.func"]

    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, MLP {args.layers}x"
        f"{args.width}, batch {args.batch}, {args.steps} timed steps (median)"
    )
    print(f"{'variant':<28} {'ms/step':>9} {'vs eager':>9} {'first call s':>13} {'max |diff|':>11}")
    for name, (ms, (trained, _, _)) in results.items():
        diff = max(float((trained[k] - reference[k]).abs().max()) for k in reference)
        print(
            f"{name:<28} {ms:>9.2f} {ms / reference_ms:>9.3f} {first_call[name]:>13.1f} "
            f"{diff:>11.2e}"
        )
    print("target: fddp within 1.02x of eager in a world of one; max |diff| below 1e-5")


if __name__ == "__main__":
    main()
