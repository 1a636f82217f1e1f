"""torchrun --standalone --nproc_per_node=2 examples/train_gpt_diloco.py

The character-level GPT of examples/train_gpt.py trained with DiLoCo (fddp.diloco): every rank
takes ``--every`` AdamW steps on its own shard of the data without communicating, then the
ranks average their parameter change and apply it with the outer Nesterov SGD (lr 0.7,
momentum 0.9). One all-reduce per ``--every`` steps instead of one per step; with
``--fragments F --delay 1 --bf16`` the streaming variant sends 1/F of the model at a time, in
bf16, overlapped with an inner step. Rank 0 evaluates the synchronized parameters on held-out
files. Also runs as a world of one: ``python examples/train_gpt_diloco.py --steps 6 --every 3``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from train_gpt import GPT, HELD_OUT, Vocab, fixed_windows, load_corpus, sample_batch

import fddp
import fddp.optim as optim


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--every", type=int, default=50, help="inner steps between syncs (H)")
    p.add_argument("--fragments", type=int, default=1, help="streaming: fragments (F)")
    p.add_argument("--delay", type=int, default=0, help="streaming: overlap delay (tau)")
    p.add_argument("--bf16", action="store_true", help="send the outer gradients in bf16")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    log = print if rank == 0 else lambda *a, **k: None

    data = load_corpus()
    vocab = Vocab("".join(sorted(set(data))))
    ids = vocab.encode(data)
    split = int(len(ids) * (1 - HELD_OUT))
    train_data, eval_data = ids[:split], ids[split:]

    torch.manual_seed(args.seed)
    model = GPT(len(vocab.chars), args.seq, args.dim, args.layers, args.heads)
    params, buffers = fddp.state(model)
    params = fddp.replicate(params)
    apply = fddp.functional(model)
    inner = optim.adamw(lr=args.lr, weight_decay=0.1)
    opt_state = inner.init(params)

    def loss_fn(params, x, y):
        return F.cross_entropy(apply(params, buffers, x).flatten(0, 1), y.flatten())

    def inner_step(params, opt_state, x, y):  # the data-parallel step without its pmean
        loss, grads = fddp.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = inner.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    step = fddp.diloco(
        inner_step,
        every=args.every,
        fragments=args.fragments,
        delay=args.delay,
        comm_dtype=torch.bfloat16 if args.bf16 else None,
        donate_argnums=(1, 2),
    )
    state = step.init(params)

    eval_x, eval_y = fddp.shard(fixed_windows(eval_data, args.seq))

    @torch.no_grad()
    def evaluate(params) -> float:
        return fddp.pmean(loss_fn(params, eval_x, eval_y)).item()

    log(f"{world} rank(s) x batch {args.batch} x {args.seq}; DiLoCo every {args.every} steps")
    log(f"step 0: eval loss {evaluate(params):.3f}")
    gen = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        x, y = fddp.shard(sample_batch(train_data, world * args.batch, args.seq, gen))
        state, params, opt_state, loss = step(state, params, opt_state, x, y)
        if i % args.every == 0:  # state.params: the synchronized parameters
            log(
                f"step {i}: rank-0 train loss {loss.item():.3f}, eval loss "
                f"{evaluate(state.params):.3f} ({time.perf_counter() - start:.1f} s)"
            )
    log(f"final eval loss {evaluate(state.params):.3f}")


if __name__ == "__main__":
    main()
