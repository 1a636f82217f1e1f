"""What runs in each timed block: fddp, DDP, local training, a forward pass, one all-reduce."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from workloads import Workload, build_model

import fddp
import fddp.optim as optim

LR, WEIGHT_DECAY = 1e-3, 0.01
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Spec:
    """Which variant to build: ``kind`` is local, fddp, ddp, forward or allreduce."""

    kind: str
    bucket_mb: float | None = None
    compile: bool = False
    donate: bool = True

    @property
    def name(self) -> str:
        name = self.kind
        if self.bucket_mb is not None:
            name += f"@{self.bucket_mb:g}"
        name += "" if self.donate else "-nodonate"
        return name + ("+compile" if self.compile else "")


class Variant:
    """One timed thing: ``step(batch)`` runs a training step (or a probe) to completion."""

    spec: Spec

    def step(self, batch: Batch) -> None:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """Facts known after a few steps: bytes per all-reduce, capture time."""
        return {}

    def parameters(self) -> dict[str, torch.Tensor] | None:
        """The trained parameters by name, for the parity check (None for probes)."""
        return None


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v.detach() for k, v in model.named_parameters()}


class Local(Variant):
    """Plain eager training of this rank's share, no communication."""

    def __init__(self, spec: Spec, workload: Workload, device: torch.device) -> None:
        self.spec, self.workload = spec, workload
        self.model = build_model(workload, device)
        self.opt = _adamw(self.model)

    def step(self, batch: Batch) -> None:
        x, y = batch
        self.workload.loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def parameters(self) -> dict[str, torch.Tensor]:
        return _named(self.model)


class DDP(Local):
    """``DistributedDataParallel`` (its defaults unless a bucket size is given), AdamW foreach."""

    def __init__(self, spec: Spec, workload: Workload, device: torch.device) -> None:
        self.spec, self.workload = spec, workload
        kwargs: dict[str, Any] = {}
        if spec.bucket_mb is not None:
            kwargs["bucket_cap_mb"] = spec.bucket_mb
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        self.ddp = DistributedDataParallel(build_model(workload, device), **kwargs)
        self.model = torch.compile(self.ddp) if spec.compile else self.ddp
        self.opt = _adamw(self.ddp)

    def parameters(self) -> dict[str, torch.Tensor]:
        return _named(self.ddp)

    def info(self) -> dict[str, Any]:
        data = self.ddp._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
        return {"allreduce_bytes": [int(s) for s in str(sizes).split(",") if s.strip()]}


class Fddp(Variant):
    """``fddp.data_parallel`` over a pure step, params and optimizer state donated; its own
    default bucket size unless one is given."""

    def __init__(self, spec: Spec, workload: Workload, device: torch.device) -> None:
        self.spec = spec
        model = build_model(workload, device)
        params, buffers = fddp.state(model)
        params = fddp.replicate(params)
        opt = optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
        self.state = [params, opt.init(params), buffers]
        step = _fddp_step(model, workload, opt)
        kwargs: dict[str, Any] = {} if spec.bucket_mb is None else {"bucket_cap_mb": spec.bucket_mb}
        self.pstep = fddp.data_parallel(
            step, compile=spec.compile, donate_argnums=(0, 1) if spec.donate else (), **kwargs
        )
        self.first_call_s: float | None = None
        self._last_batch: Batch | None = None

    def step(self, batch: Batch) -> None:
        start = time.perf_counter()
        params, opt_state, buffers, _ = self.pstep(*self.state, batch)
        if self.first_call_s is None:
            self.first_call_s = time.perf_counter() - start
        self.state = [params, opt_state, buffers]
        self._last_batch = batch

    def info(self) -> dict[str, Any]:
        plan = self.pstep.schedule(*self.state, self._last_batch)
        return {
            "allreduce_bytes": [c.nbytes for c in plan.collectives if c.kind.startswith("all_red")],
            "collectives": [
                {"kind": c.kind, "bucket": c.bucket, "nbytes": c.nbytes, "overlap": c.overlapped}
                for c in plan.collectives
            ],
            "capture_s": plan.capture_seconds,
            "first_call_s": self.first_call_s,
            "retraces": self.pstep.retraces,
            "plan": str(plan),
        }

    def parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.state[0])


def _fddp_step(model: nn.Module, workload: Workload, opt: optim.GradientTransformation) -> Callable:
    """The pure step; BatchNorm buffers start from rank 0's values, as DDP broadcasts them."""
    apply = fddp.functional(model, return_buffers=workload.has_buffers)

    def loss_fn(params: dict, buffers: dict, batch: Batch) -> torch.Tensor:
        x, y = batch
        return workload.loss(apply(params, buffers, x), y)

    def loss_bn(params: dict, buffers: dict, batch: Batch) -> tuple[torch.Tensor, dict]:
        x, y = batch
        out, buffers = apply(params, buffers, x)
        return workload.loss(out, y), buffers

    def step(params: dict, opt_state: Any, buffers: dict, batch: Batch) -> tuple:
        if workload.has_buffers:
            buffers = fddp.broadcast(buffers, src=0)
            (loss, buffers), grads = fddp.value_and_grad(loss_bn, has_aux=True)(
                params, buffers, batch
            )
        else:
            loss, grads = fddp.value_and_grad(loss_fn)(params, buffers, batch)
        grads = fddp.pmean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, buffers, fddp.pmean(loss)

    return step


class Forward(Local):
    """The forward pass and loss alone (autograd recording on): what no all-reduce can hide."""

    def step(self, batch: Batch) -> None:
        x, y = batch
        self.workload.loss(self.model(x), y)

    def parameters(self) -> None:
        return None


class AllReduce(Variant):
    """One all-reduce of a flat fp32 buffer holding every gradient, as the link sees it."""

    def __init__(self, spec: Spec, workload: Workload, device: torch.device) -> None:
        self.spec = spec
        numel = sum(p.numel() for p in build_model(workload, device).parameters())
        self.flat = torch.zeros(numel, device=device)

    def step(self, batch: Batch) -> None:
        dist.all_reduce(self.flat)

    def info(self) -> dict[str, Any]:
        return {"allreduce_bytes": [self.flat.numel() * self.flat.element_size()]}


KINDS: dict[str, type[Variant]] = {
    "local": Local,
    "fddp": Fddp,
    "ddp": DDP,
    "forward": Forward,
    "allreduce": AllReduce,
}


def build(spec: Spec, workload: Workload, device: torch.device) -> Variant:
    return KINDS[spec.kind](spec, workload, device)
