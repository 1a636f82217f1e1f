"""torchrun --standalone --nproc_per_node=2 docs/guides/ddp_loop.py (or plain python: one rank)"""

import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fddp
import fddp.optim as optim

fddp.init()
torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
sampler = DistributedSampler(data, fddp.world_size(), fddp.rank(), shuffle=True, drop_last=True)
loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)  # same shapes everywhere

model = torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
)
params, buffers = fddp.state(model)
params = fddp.replicate(params)  # DDP copies rank 0's parameters too
apply = fddp.functional(model, return_buffers=True)  # BatchNorm: (logits, new running stats)

epochs = 3
schedule = optim.warmup_cosine_decay_schedule(
    0.0, 1e-2, warmup_steps=10, decay_steps=epochs * len(loader)
)
opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=schedule, weight_decay=0.01))
opt_state = opt.init(params)


def loss_fn(params, buffers, x, y):
    logits, buffers = apply(params, buffers, x)
    return F.cross_entropy(logits, y), buffers


@fddp.data_parallel(donate_argnums=(0, 1))
def step(params, opt_state, buffers, x, y):
    (loss, buffers), grads = fddp.value_and_grad(loss_fn, has_aux=True)(params, buffers, x, y)
    grads = fddp.pmean(grads)  # DDP's all-reduce in backward()
    buffers = fddp.nn.sync_buffers(buffers, "broadcast")  # DDP's broadcast_buffers=True
    grad_norm = optim.global_norm(grads)  # what clip_grad_norm_ returns: the norm before clipping
    updates, opt_state = opt.update(grads, opt_state, params)  # clip, then AdamW at the schedule
    return optim.apply_updates(params, updates), opt_state, buffers, fddp.pmean(loss), grad_norm


checkpoint = "ddp_loop.ckpt"
start = 0
if os.path.exists(checkpoint):  # resume: every rank loads the same file
    like = {"params": params, "opt": opt_state, "buffers": buffers, "epoch": 0}
    saved = fddp.load(checkpoint, like=like)
    params, opt_state, buffers = saved["params"], saved["opt"], saved["buffers"]
    start = saved["epoch"]

for epoch in range(start, epochs):
    sampler.set_epoch(epoch)
    model.train()
    for x, y in loader:
        params, opt_state, buffers, loss, grad_norm = step(params, opt_state, buffers, x, y)
    state = {"params": params, "opt": opt_state, "buffers": buffers, "epoch": epoch + 1}
    fddp.save(checkpoint, state)  # every rank calls it, rank 0 writes
    model.eval()  # eval mode: running statistics
    logits, _ = apply(params, buffers, data.tensors[0][:128])
    accuracy = (logits.argmax(1) == data.tensors[1][:128]).float().mean()
    if fddp.rank() == 0:
        print(
            f"epoch {epoch}: loss {loss.item():.3f}, grad norm {grad_norm.item():.3f}, "
            f"accuracy {accuracy.item():.2f}"
        )
