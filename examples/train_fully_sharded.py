"""torchrun --standalone --nproc_per_node=2 examples/train_fully_sharded.py

A GPT of about a billion parameters (examples/train_gpt.py's decoder-only transformer, by
default 20 layers of width 2048 over 8192 tokens: 1,040,986,112 parameters) trained with fully
sharded parameters (fddp.shard_params, ZeRO-3) and a sharded AdamW (fddp.optim.shard_state) on
2 CPU ranks of a 24 GiB machine. Replicated, AdamW needs 16 bytes per parameter on every rank
(parameters, gradients and the two moments: 16.7 GB per rank, 33 GB for the two), more than the
machine has; fully sharded, each rank keeps 1/N of the parameters and of the optimizer state at
rest (6 bytes per parameter on 2 ranks: 6.2 GB), and the step gathers each bucket of
parameters just before its use and frees it after, gathering it again for the backward pass,
while the gradients are reduce-scattered bucket by bucket. Measured on 2 cores and 24 GiB: a
peak RSS of 9.7 GB per rank (under 20 GB used in all), 3 steps in about 6 minutes (44 s a step
once captured). Each rank builds the full parameters once, keeps its shards and frees the rest.

The step is the replicated step without the pmean of the gradients (shard_state
reduce-scatters them); passing the ShardedParams where it takes its parameters is the whole
change. The data are random tokens (nothing downloads), so the loss stays near ln(vocab), the
loss of a uniform guess; the point is the memory. Every rank prints its parameter count, its
bytes at rest against replicated AdamW's, its peak RSS and the time of each step.
Also runs as a world of one, unsharded in effect: ``python examples/train_fully_sharded.py
--layers 2 --dim 256``.
"""

from __future__ import annotations

import argparse
import functools
import math
import resource
import sys
import time

import torch
import torch.nn.functional as F
from train_gpt import GPT

import fddp
import fddp.optim as optim

REPLICATED_ADAMW_BYTES = 16  # fp32 parameter, gradient, first and second moment


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=128, help="context length in tokens")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--show-schedule", action="store_true", help="print the whole plan")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def peak_rss() -> int:
    """This process's peak resident memory so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)


def size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def build(args: argparse.Namespace) -> tuple[GPT, dict[str, torch.Tensor]]:
    """The model's structure on the meta device (no memory), and its parameters, initialized
    on the CPU once: the only full copy a rank ever holds. The module keeps none of them;
    ``fddp.functional`` runs it on the tensors it is given."""
    with torch.device("meta"):
        model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads)
    model.to_empty(device="cpu")
    torch.manual_seed(args.seed)  # the same values on every rank, as shard_params expects
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    params, _ = fddp.state(model)  # detached, sharing the module's storage
    model.to("meta")  # the module lets go of it: `params` is now the only reference
    return model, params


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    log = print if rank == 0 else lambda *a, **k: None

    model, params = build(args)
    buffers: dict[str, torch.Tensor] = {}  # this GPT has none
    apply = fddp.functional(model)
    count = sum(p.numel() for p in params.values())
    shapes = {name: (p.shape, p.dtype) for name, p in params.items()}

    sharded = fddp.shard_params(params)  # this rank's 1/N of every bucket, copied
    del params  # the full copy is gone from here on

    opt = optim.shard_state(optim.adamw(args.lr, weight_decay=0.1))
    # AdamW's moments start at zero whatever the parameters' values, so its init needs only
    # their shapes and dtypes: zero-stride stand-ins that hold no memory, where the full
    # parameters would put a full copy, the shards and the sharded state in memory at once
    # (12 GB per rank at the default size). init runs where the "data" axis is bound, so
    # that only this rank's shard of the state is made.
    like = {name: torch.zeros((), dtype=d).expand(s) for name, (s, d) in shapes.items()}
    opt_state = fddp.data_parallel(lambda p: opt.init(p), trace=False)(like)
    del like

    at_rest = optim.state_bytes(sharded) + optim.state_bytes(opt_state)
    replicated = REPLICATED_ADAMW_BYTES * count
    print(
        f"rank {rank}: {count:,} parameters; at rest {size(at_rest)} on this rank "
        f"(parameters {size(optim.state_bytes(sharded))} + AdamW state "
        f"{size(optim.state_bytes(opt_state))}; replicated AdamW: "
        f"{size(replicated)}); peak RSS after setup {size(peak_rss())}",
        flush=True,
    )
    log(
        f"{world} rank(s) x batch {args.batch} x {args.seq}; {args.layers} layers of width "
        f"{args.dim}, vocab {args.vocab}; a uniform guess's loss: {math.log(args.vocab):.3f}",
        flush=True,
    )

    def loss_fn(params, x, y):
        logits = apply(params, buffers, x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @functools.partial(fddp.data_parallel, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):  # params: the full tree, gathered bucket by bucket
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)  # reduce-scatters grads
        return optim.apply_updates(params, updates), opt_state, fddp.pmean(loss)

    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    for i in range(1, args.steps + 1):
        tokens = torch.randint(args.vocab, (world * args.batch, args.seq + 1), generator=gen)
        x, y = fddp.shard((tokens[:, :-1], tokens[:, 1:]))
        t = time.perf_counter()
        sharded, opt_state, loss = step(sharded, opt_state, x, y)  # comes back sharded
        loss = loss.item()
        seconds = time.perf_counter() - t
        if not math.isfinite(loss):
            raise SystemExit(f"rank {rank}: step {i}: loss {loss} is not finite")
        first = " (includes the capture)" if i == 1 else ""
        print(
            f"rank {rank}: step {i}: loss {loss:.4f}, {seconds:.1f} s{first}, "
            f"peak RSS {size(peak_rss())}",
            flush=True,
        )
        if i == 1:
            plan = step.schedule(sharded, opt_state, x, y)
            others = len(plan.collectives) - len(plan.gathers)
            log(
                f"schedule (rank 0): {len(plan.gathers)} parameter gathers for "
                f"{len(sharded.shards)} buckets, {others} other collectives (the gradients' "
                "reduce-scatters and the loss's all-reduce)",
                flush=True,
            )
            if args.show_schedule:
                log(plan, flush=True)

    at_rest = optim.state_bytes(sharded) + optim.state_bytes(opt_state)
    print(
        f"rank {rank}: done: {count:,} parameters trained fully sharded on {world} rank(s); "
        f"at rest {size(at_rest)} on this rank (replicated AdamW: "
        f"{size(replicated)}); peak RSS {size(peak_rss())}",
        flush=True,
    )


if __name__ == "__main__":
    main()
