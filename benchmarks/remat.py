"""Activation rematerialisation per policy against eager and FSDP2 checkpointing, on 2 gloo ranks:
python benchmarks/remat.py    # deep32 (32 layers, width 256, sequence 512) and gpt, ~12 min

Per variant, in one run: the bytes saved for backward (fddp: counted in the plan,
``pstep.schedule(...)``; eager and FSDP2: the tensors the step holds when its forward ends, by the
profiler's allocation events), the peak live tensor bytes within one step (the profiler's
allocation events summed in time order from the step's start, as ``step_memory.py`` counts them:
parameters and optimizer state already held are not in it), and the median step time (variants
interleaved round by round, the slowest rank per step). The report goes to
``benchmarks/results/<date>_remat.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import provenance
import ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import workloads
from step_memory import peak_bytes
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint
from workloads import GPT, Workload

import fddp
import fddp.optim as optim

RESULTS = Path(__file__).resolve().parent / "results"
LR, WEIGHT_DECAY = 1e-3, 0.01
FORWARD_END = "remat-bench: forward ends"


class NamedBlock(nn.Module):
    """The workloads' transformer block, its attention output named ``"attention"`` and its MLP
    hidden activation ``"mlp_hidden"`` for ``save_only_these_names`` (names are identities
    outside a remat region)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        att = fddp.remat_name(att, "attention")
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(fddp.remat_name(F.gelu(self.fc(self.ln2(x))), "mlp_hidden"))


def _named_gpt(vocab: int, seq: int, dim: int, heads: int, layers: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = GPT(vocab, seq, dim, heads, layers)
        model.blocks = nn.ModuleList(NamedBlock(dim, heads) for _ in range(layers))
        return model

    return build


WORKLOADS = {
    "deep32": Workload(
        "deep32",
        _named_gpt(256, 512, dim=256, heads=4, layers=32),
        workloads._token_batches(256, 512),
        workloads._token_loss,
        per_rank=1,
    ),
    "gpt": dataclasses.replace(
        workloads.WORKLOADS["gpt"],
        build=_named_gpt(workloads.GPT_VOCAB, workloads.GPT_SEQ, dim=256, heads=4, layers=10),
    ),
}
LAYERS = {"deep32": 32, "gpt": 10}


def policies() -> dict[str, Any]:
    """The policies measured, by the name the report shows."""
    p = fddp.remat_policies
    return {
        "none": None,
        "nothing_saveable": p.nothing_saveable,
        "dots_with_no_batch_dims_saveable": p.dots_with_no_batch_dims_saveable,
        "save_only_these_names(attention)": p.save_only_these_names("attention"),
        "memory_budget(0.5)": p.memory_budget(fraction=0.5),
        "memory_budget(0.25)": p.memory_budget(fraction=0.25),
    }


@dataclasses.dataclass
class Variant:
    """``step(batch)`` runs one training step; ``saved()`` the bytes it holds for backward."""

    step: Callable[[Any], None]
    saved: Callable[[Any], dict[str, int]]


def _model(workload: Workload) -> nn.Module:
    torch.manual_seed(workloads.SEED)
    return workload.build().train()


def fddp_variant(workload: Workload, policy: Any, *, sharded: bool = False) -> Variant:
    """``fddp.data_parallel(step, remat=policy)``, params and AdamW state donated; with
    ``sharded``, parameters and state fully sharded (``shard_params`` + ``shard_state``)."""
    model = _model(workload)
    apply = fddp.functional(model)
    params, buffers = fddp.state(model)
    params = fddp.replicate(params)
    opt = optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
    opt = optim.shard_state(opt) if sharded else opt
    state = [fddp.shard_params(params) if sharded else params, opt.init(params)]
    del params

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return workload.loss(apply(p, buffers, x), y)

    def step(p: dict, opt_state: Any, batch: tuple) -> tuple:
        loss, grads = fddp.value_and_grad(loss_fn)(p, batch)
        grads = grads if sharded else fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optim.apply_updates(p, updates), opt_state, fddp.pmean(loss)

    pstep = fddp.data_parallel(step, remat=policy, donate_argnums=(0, 1))

    def run(batch: Any) -> None:
        p, s, _ = pstep(*state, batch)
        state[:] = [p, s]

    def saved(batch: Any) -> dict[str, int]:
        remat = pstep.schedule(*state, batch).remat
        if remat is None:  # no region: the plan has nothing to count
            return {}
        return {"saved_bytes": remat.saved_bytes, "saved_bytes_without": remat.saved_bytes_without}

    return Variant(run, saved)


def eager_variant(workload: Workload, *, fsdp: bool, ckpt: bool) -> Variant:
    """DDP (or FSDP2's ``fully_shard`` per block and on the root) with AdamW foreach; with
    ``ckpt``, every block under ``torch.utils.checkpoint`` (DDP: ``checkpoint(block, x,
    use_reentrant=False)``; FSDP2: ``checkpoint_wrapper``, applied before ``fully_shard`` as
    torchtitan does)."""
    model = _model(workload)
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    if ckpt and fsdp:
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    elif ckpt:
        for block in blocks:
            block.forward = _checkpointed(block.forward)  # type: ignore[method-assign]
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)

    def run(batch: Any) -> None:
        x, y = batch
        loss = workload.loss(wrapped(x), y)
        with record_function(FORWARD_END):
            pass
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Variant(run, lambda batch: {})


def _checkpointed(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)

    return run


def variants(workload: Workload) -> dict[str, Callable[[], Variant]]:
    out: dict[str, Callable[[], Variant]] = {
        f"fddp {name}": (lambda p=p: fddp_variant(workload, p)) for name, p in policies().items()
    }
    full = fddp.remat_policies.nothing_saveable
    out["fddp sharded nothing_saveable"] = lambda: fddp_variant(workload, full, sharded=True)
    out["ddp"] = lambda: eager_variant(workload, fsdp=False, ckpt=False)
    out["ddp + checkpoint"] = lambda: eager_variant(workload, fsdp=False, ckpt=True)
    out["fsdp2 + checkpoint"] = lambda: eager_variant(workload, fsdp=True, ckpt=True)
    return out


def held_after_forward(prof: profile) -> int:
    """Tensor bytes the step allocated and still holds when its forward ends."""
    ends = [e for e in prof.events() if e.name == FORWARD_END]
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    start_ns = min(e.start_ns() for e in events)
    ends_ns = start_ns + int(ends[0].time_range.start * 1000)
    return sum(e.nbytes() for e in events if e.start_ns() <= ends_ns)


def _measure(name: str, variant: Variant, batches: list, warmup: int) -> dict[str, Any]:
    for i in range(warmup):
        variant.step(batches[i % len(batches)])
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        variant.step(batches[0])
    facts = {"peak_bytes": peak_bytes(prof), **variant.saved(batches[0])}
    if name.startswith(("ddp", "fsdp2")):
        facts["saved_bytes"] = held_after_forward(prof)
    return facts


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    ranks.join_world(rank, world, port, 1)
    results = {}
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        batches = workloads.rank_batches(workload, world, rank, torch.device("cpu"))
        built: dict[str, Variant] = {}
        facts: dict[str, dict[str, Any]] = {}
        for vname, make in variants(workload).items():
            dist.barrier()
            start = time.perf_counter()
            built[vname] = make()
            built[vname].step(batches[0])
            facts[vname] = {"first_call_s": time.perf_counter() - start}
            facts[vname].update(_measure(vname, built[vname], batches, args.warmup))
            if rank == 0:
                print(f"{name} {vname}: {facts[vname]}", flush=True)
        times: dict[str, list[float]] = {v: [] for v in built}
        order = list(built)
        for r in range(args.rounds):
            for vname in order[r % len(order) :] + order[: r % len(order)]:
                gc.collect()
                dist.barrier()
                start = time.perf_counter()
                built[vname].step(batches[r % len(batches)])
                took = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times[vname].append(took.item())
        without = facts["fddp nothing_saveable"]["saved_bytes_without"]
        facts["fddp none"]["saved_bytes"] = without  # what the plan counts without remat
        for vname in built:
            peaks = [None] * world
            dist.all_gather_object(peaks, facts[vname]["peak_bytes"])
            facts[vname]["peak_bytes"] = max(p for p in peaks if p is not None)
            facts[vname]["times_s"] = times[vname]
        results[name] = {"layers": LAYERS[name], "per_rank": workload.per_rank, "variants": facts}
        del built
        gc.collect()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def report(results: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown report: a table per workload, ratios to fddp without remat, the targets."""
    lines = [f"# Activation rematerialisation ({meta['date']})", ""]
    lines += [f"`{meta['command']}` — torch {meta['torch']}, commit {meta['commit']}", ""]
    for name, res in results.items():
        v = res["variants"]
        base = v["fddp none"]
        med = {k: statistics.median(x["times_s"]) for k, x in v.items()}
        lines += [
            f"## {name} ({res['layers']} layers, {res['per_rank']} rows per rank, 2 ranks)",
            "",
            "| variant | saved for backward MiB | vs none | peak live MiB | vs none | step s "
            "| vs none |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for k, x in v.items():
            lines.append(
                f"| {k} | {x['saved_bytes'] / 2**20:.1f} | "
                f"{x['saved_bytes'] / base['saved_bytes']:.3f} | {x['peak_bytes'] / 2**20:.1f} | "
                f"{x['peak_bytes'] / base['peak_bytes']:.3f} | {med[k]:.3f} | "
                f"{med[k] / med['fddp none']:.2f} |"
            )
        lines += ["", *_targets(res, med), ""]
    lines += [
        "Saved for backward: fddp rows from the plan (`pstep.schedule(...).remat.saved_bytes`); "
        "ddp/fsdp2 rows are the tensor bytes the step allocated and still held when its forward "
        "ended (profiler allocation events). Peak live: the profiler's allocation events of one "
        "step after warm-up, summed in time order from the step's start (parameters and "
        "optimizer state held before the step are not counted), the larger of the 2 ranks. "
        "Step: median over the interleaved rounds of the slower rank's wall time.",
    ]
    return "\n".join(lines) + "\n"


def _targets(res: dict[str, Any], med: dict[str, float]) -> list[str]:
    v, layers = res["variants"], res["layers"]
    none = v["fddp none"]["saved_bytes"]
    full = v["fddp nothing_saveable"]["saved_bytes"]
    bound = 2 * none / layers  # 1/L of no-remat activations plus one layer's worth
    out = [
        f"- full policy: saved {full / 2**20:.1f} MiB against the bound 1/L + one layer = "
        f"{bound / 2**20:.1f} MiB (x1.1 = {1.1 * bound / 2**20:.1f}): "
        f"{'met' if full <= 1.1 * bound else 'NOT met'}; step time "
        f"{med['fddp nothing_saveable'] / med['fddp none']:.2f}x of none (target <= 1.4): "
        f"{'met' if med['fddp nothing_saveable'] <= 1.4 * med['fddp none'] else 'NOT met'}",
    ]
    for fraction in (0.5, 0.25):
        got = v[f"fddp memory_budget({fraction})"]["saved_bytes"]
        met = "met" if got <= 1.1 * fraction * none else "NOT met"
        out.append(
            f"- memory_budget({fraction}): saved {got / none:.3f} of none "
            f"(target {fraction} within 10 %: {met})"
        )
    for ours, theirs in (
        ("fddp nothing_saveable", "ddp + checkpoint"),
        ("fddp sharded nothing_saveable", "fsdp2 + checkpoint"),
    ):
        out.append(
            f"- {ours} / {theirs}: peak {v[ours]['peak_bytes'] / v[theirs]['peak_bytes']:.2f}, "
            f"step time {med[ours] / med[theirs]:.2f}"
        )
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split(":")[0])
    p.add_argument("--workloads", default="deep32,gpt")
    p.add_argument("--warmup", type=int, default=1, help="steps after the first, untimed")
    p.add_argument("--rounds", type=int, default=2, help="timed steps per variant, interleaved")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    commit = provenance.commit()  # the code the ranks import
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_rank_main, args=(2, ranks.free_port(), args, out), nprocs=2)
    results = out.get()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    meta = {
        "date": stamp,
        "command": "python benchmarks/remat.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "commit": commit,
    }
    text = report(results, meta)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{stamp}_remat.json").write_text(json.dumps({**meta, "results": results}))
    (Path(args.out) / f"{stamp}_remat.md").write_text(text)


if __name__ == "__main__":
    main()
