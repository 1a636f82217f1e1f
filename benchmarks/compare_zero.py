"""Sharded optimizer state: fddp with and without fddp.optim.shard_state, DDP with and without
ZeroRedundancyOptimizer, interleaved in one run; median ms/step and optimizer-state bytes per rank.

    python benchmarks/compare_zero.py [--workload mlp] [--steps 30] [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from workloads import WORKLOADS, Workload, build_model, param_count, rank_batches

import fddp
import fddp.optim as optim

LR, WEIGHT_DECAY = 1e-3, 0.01
VARIANTS = ("fddp", "fddp-zero", "ddp", "ddp-zero")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--block", type=int, default=2, help="steps per interleaved block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--zero-bucket-mb", type=float, help="shard_state's bucket_cap_mb")
    p.add_argument("--plan", action="store_true", help="print fddp-zero's compiled schedule")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class FddpVariant:
    """``data_parallel`` over a pure AdamW step, params and optimizer state donated."""

    def __init__(self, workload: Workload, sharded: bool, bucket_mb: float | None = None) -> None:
        model = build_model(workload, torch.device("cpu"))
        apply = fddp.functional(model)
        params, buffers = fddp.state(model)
        params = fddp.replicate(params)
        opt = optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
        opt = optim.shard_state(opt, bucket_cap_mb=bucket_mb) if sharded else opt

        def loss_fn(params: dict, batch: tuple) -> torch.Tensor:
            x, y = batch
            return workload.loss(apply(params, buffers, x), y)

        def step(params: dict, opt_state: Any, batch: tuple) -> tuple:
            loss, grads = fddp.value_and_grad(loss_fn)(params, batch)
            if not sharded:
                grads = fddp.pmean(grads)  # with shard_state: the only line that goes
            updates, opt_state = opt.update(grads, opt_state, params)
            return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

        self.pstep = fddp.data_parallel(step, donate_argnums=(0, 1))
        self.params, self.state = params, opt.init(params)  # "data": the default group

    def step(self, batch: tuple) -> None:
        self.params, self.state, _ = self.pstep(self.params, self.state, batch)

    def state_bytes(self) -> int:
        return optim.state_bytes(self.state)

    def parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.params)

    def plan(self, batch: tuple) -> str:
        return str(self.pstep.schedule(self.params, self.state, batch))


class DdpVariant:
    """DDP (default buckets) with AdamW foreach, or with ZeroRedundancyOptimizer over it."""

    def __init__(self, workload: Workload, sharded: bool) -> None:
        self.workload = workload
        self.ddp = DistributedDataParallel(build_model(workload, torch.device("cpu")))
        kwargs = {"lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": True}
        if sharded:
            self.opt = ZeroRedundancyOptimizer(
                self.ddp.parameters(), optimizer_class=torch.optim.AdamW, **kwargs
            )
        else:
            self.opt = torch.optim.AdamW(self.ddp.parameters(), **kwargs)

    def step(self, batch: tuple) -> None:
        x, y = batch
        self.workload.loss(self.ddp(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        local = self.opt.optim if isinstance(self.opt, ZeroRedundancyOptimizer) else self.opt
        return sum(_bytes(s.values()) for s in local.state.values())

    def parameters(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("module."): v.detach() for k, v in self.ddp.named_parameters()}


def _build(name: str, workload: Workload, args: argparse.Namespace) -> FddpVariant | DdpVariant:
    sharded = name.endswith("-zero")
    if name.startswith("fddp"):
        return FddpVariant(workload, sharded, args.zero_bucket_mb)
    return DdpVariant(workload, sharded)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    ranks.join_world(rank, world, port, args.threads)
    workload = WORKLOADS[args.workload]
    batches = rank_batches(workload, world, rank, torch.device("cpu"))
    built = {name: _build(name, workload, args) for name in VARIANTS}
    steps = dict.fromkeys(VARIANTS, 0)

    def run(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        built[name].step(batches[steps[name] % len(batches)])
        steps[name] += 1
        return time.perf_counter() - start

    first = {name: run(name) for name in VARIANTS}
    for _ in range(args.warmup):
        for name in VARIANTS:
            run(name)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    rounds = -(-args.steps // args.block)
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name in order:
            times[name] += [run(name) for _ in range(args.block)]
    params = {name: built[name].parameters() for name in VARIANTS}
    result = {
        "workload": args.workload,
        "params": param_count(build_model(workload, torch.device("cpu"))),
        "world": world,
        "steps": {name: steps[name] for name in VARIANTS},
        "first_call_s": first,
        "median_ms": {name: 1e3 * statistics.median(times[name]) for name in VARIANTS},
        "state_bytes": {name: built[name].state_bytes() for name in VARIANTS},
        "max_diff": {
            "fddp-zero vs fddp": _max_diff(params["fddp"], params["fddp-zero"]),
            "ddp-zero vs ddp": _max_diff(params["ddp"], params["ddp-zero"]),
            "fddp vs ddp": _max_diff(params["fddp"], params["ddp"]),
        },
    }
    if args.plan:
        result["plan"] = built["fddp-zero"].plan(batches[0])
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result["state_bytes"])
    result["state_bytes_per_rank"] = gathered
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def report(result: dict[str, Any]) -> str:
    ms, nbytes = result["median_ms"], result["state_bytes_per_rank"]
    lines = [
        f"{result['workload']}: {result['params'] / 1e6:.1f}M parameters, AdamW, "
        f"{result['world']} gloo ranks on loopback, interleaved",
        f"{'variant':<10} {'ms/step':>8} {'vs fddp':>8}  optimizer state per rank (MB)",
    ]
    for name in VARIANTS:
        per_rank = ", ".join(f"{b[name] / 1e6:.1f}" for b in nbytes)
        lines.append(f"{name:<10} {ms[name]:>8.1f} {ms[name] / ms['fddp']:>7.2f}x  {per_rank}")
    lines.append(
        "max |param diff| after the run: "
        + ", ".join(f"{k} {v:.1e}" for k, v in result["max_diff"].items())
    )
    if "plan" in result:
        lines += ["fddp-zero schedule:", result["plan"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        port = ranks.free_port()
        mp.spawn(_rank_main, args=(args.world_size, port, args, out), nprocs=args.world_size)
        with open(out) as f:
            result = json.load(f)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
