"""Batch statistics across replicas: synchronised BatchNorm, and explicit buffer sync choices."""

from __future__ import annotations

import copy
from typing import Any, Literal

import optree
import torch
import torch.nn.functional as F
from torch import nn

from fddp._base._axes import DEFAULT_AXIS
from fddp._base._tree import tensor_leaves
from fddp._collectives._ops import all_gather, broadcast, pmean

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def sync_batch_norm(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    training: bool = True,
    momentum: float | torch.Tensor = 0.1,
    eps: float = 1e-5,
    axis_name: str = DEFAULT_AXIS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Batch normalisation with statistics over the global batch of every replica of an axis.

    In training, each channel (dim 1 of ``x``) is normalised with the mean and biased variance
    of all rows on all replicas of ``axis_name``, as ``torch.nn.SyncBatchNorm`` does: every
    replica contributes its row count, mean and sum of squared deviations through one
    ``all_gather`` (so replicas may hold different numbers of rows, even none), and the gradient
    flows back through that reduction to every replica's input. The running statistics are
    updated with the global mean and the unbiased global variance. With ``training=False`` the
    running statistics normalise and nothing is communicated.

    Args:
        x: input of shape ``(N, C, *)``.
        running_mean: ``(C,)`` running mean, or None to track none.
        running_var: ``(C,)`` running variance, or None to track none.
        weight: ``(C,)`` scale, or None.
        bias: ``(C,)`` shift, or None.
        training: use batch statistics (True) or the running ones (False).
        momentum: weight of the new statistics in the running ones (a float or 0-d tensor).
        eps: added to the variance before the square root.
        axis_name: the replica axis whose rows form the global batch.

    Returns:
        ``(output, new_running_mean, new_running_var)``; the inputs are not modified, and the
        new statistics carry no gradient.

    >>> import fddp, torch
    >>> x = torch.tensor([[1.0], [3.0]])
    >>> out, mean, var = fddp.nn.sync_batch_norm(x, torch.zeros(1), torch.ones(1))
    >>> out[:, 0], mean, var
    (tensor([-1.0000,  1.0000]), tensor([0.2000]), tensor([1.1000]))
    """
    if x.dim() < 2:
        raise ValueError(
            f"sync_batch_norm expects an input of shape (N, C, ...), got {x.dim()} dimension(s); "
            "add a batch dimension (x.unsqueeze(0)) or a channel dimension."
        )
    channels = x.shape[1]
    shape = [1, channels] + [1] * (x.dim() - 2)
    if not training:
        if running_mean is None or running_var is None:
            raise ValueError(
                "sync_batch_norm with training=False normalises with the running statistics; "
                "pass running_mean and running_var, or use training=True."
            )
        out = F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)
        return out, running_mean, running_var
    stat_dtype = torch.promote_types(x.dtype, torch.float32)
    dims = [0, *range(2, x.dim())]
    rows = x.numel() // channels if channels else 0
    xs = x.to(stat_dtype)
    local_mean = xs.sum(dims) / max(rows, 1)
    local_m2 = ((xs - local_mean.view(shape)) ** 2).sum(dims)
    count = torch.full((1,), float(rows), dtype=stat_dtype, device=x.device)
    gathered = all_gather(torch.cat([count, local_mean, local_m2]), axis_name)
    counts, means, m2s = gathered[:, :1], gathered[:, 1 : 1 + channels], gathered[:, 1 + channels :]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    var = m2 / total
    out = (xs - mean.view(shape)) * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    out = out.to(x.dtype)
    new_mean, new_var = running_mean, running_var
    if running_mean is not None:
        new_mean = momentum * mean.detach().to(running_mean.dtype) + (1 - momentum) * running_mean
    if running_var is not None:
        unbiased = (m2 / (total - 1).clamp(min=1)).detach().to(running_var.dtype)
        new_var = momentum * unbiased + (1 - momentum) * running_var
    return out, new_mean, new_var


class SyncBatchNorm(nn.Module):
    """A BatchNorm layer whose training statistics span every replica of a named axis.

    Made by :func:`convert_sync_batchnorm`; it holds the same parameters and buffers under the
    same names as the layer it replaces, and runs :func:`sync_batch_norm`.
    """

    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None

    def __init__(
        self,
        layer: nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm,
        axis_name: str = DEFAULT_AXIS,
    ) -> None:
        super().__init__()
        self.num_features = layer.num_features
        self.eps = layer.eps
        self.momentum = layer.momentum
        self.affine = layer.affine
        self.track_running_stats = layer.track_running_stats
        self.axis_name = axis_name
        self.weight = layer.weight
        self.bias = layer.bias
        self.register_buffer("running_mean", layer.running_mean)
        self.register_buffer("running_var", layer.running_var)
        self.register_buffer("num_batches_tracked", layer.num_batches_tracked)
        self.train(layer.training)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}, axis_name={self.axis_name!r}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:  # as torch.nn.SyncBatchNorm: evaluation never communicates
            return F.batch_norm(
                x,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                self.running_mean is None,
                0.0,
                self.eps,
            )
        tracked = self.num_batches_tracked if self.track_running_stats else None
        factor: float | torch.Tensor = 0.0 if self.momentum is None else self.momentum
        if tracked is not None:
            tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / tracked
        running_mean = self.running_mean if tracked is not None else None
        running_var = self.running_var if tracked is not None else None
        out, mean, var = sync_batch_norm(
            x,
            running_mean,
            running_var,
            self.weight,
            self.bias,
            momentum=factor,
            eps=self.eps,
            axis_name=self.axis_name,
        )
        with torch.no_grad():
            if running_mean is not None and mean is not None:
                running_mean.copy_(mean)
            if running_var is not None and var is not None:
                running_var.copy_(var)
        return out


def convert_sync_batchnorm(model: nn.Module, *, axis_name: str = DEFAULT_AXIS) -> nn.Module:
    """A copy of ``model`` whose BatchNorm layers normalise over the global batch.

    Every ``BatchNorm1d/2d/3d`` (and ``torch.nn.SyncBatchNorm``) becomes a :class:`SyncBatchNorm`
    running :func:`sync_batch_norm` over ``axis_name``: the functional equivalent of
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, for use through ``fddp.functional``
    inside ``fddp.data_parallel`` or ``fddp.vmap``. Parameter and buffer names do not change,
    so the ``params``/``buffers`` of the original model work with the copy. ``model`` itself is
    not modified.

    >>> import fddp, torch
    >>> model = fddp.nn.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
    >>> type(model[0]).__name__, sorted(fddp.state(model)[1])
    ('SyncBatchNorm', ['0.num_batches_tracked', '0.running_mean', '0.running_var'])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_sync_batchnorm expects a torch.nn.Module, got {type(model)}.")
    model = copy.deepcopy(model)
    if isinstance(model, _BATCH_NORMS):
        return SyncBatchNorm(model, axis_name)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BATCH_NORMS):
                setattr(parent, name, SyncBatchNorm(child, axis_name))
    return model


def sync_buffers(
    buffers: Any,
    how: Literal["mean", "broadcast"],
    *,
    src: int = 0,
    axis_name: str = DEFAULT_AXIS,
) -> Any:
    """Make buffers (BatchNorm running statistics) agree across replicas, in one of DDP's ways.

    - ``"broadcast"``: every replica takes replica ``src``'s buffers, as DDP does with
      ``broadcast_buffers=True`` (its default): statistics seen by other replicas are dropped.
    - ``"mean"``: floating-point buffers are averaged over the replicas (each replica's running
      statistics are a linear update, so the mean tracks all replicas' batches); other buffers
      (``num_batches_tracked``) are left as they are, being equal everywhere. DDP with
      ``broadcast_buffers=False`` keeps per-replica buffers instead; averaging them is this.

    Call it on the new buffers inside the step; both choices keep replicas identical.

    >>> import fddp, torch
    >>> fddp.nn.sync_buffers({"running_mean": torch.tensor([0.5])}, "mean")
    {'running_mean': tensor([0.5000])}
    """
    if how == "broadcast":
        return broadcast(buffers, src, axis_name)
    if how == "mean":
        leaves, spec = tensor_leaves(buffers, "sync_buffers' buffers")
        floating = [i for i, x in enumerate(leaves) if x.is_floating_point()]
        averaged = pmean([leaves[i] for i in floating], axis_name)
        for i, x in zip(floating, averaged):
            leaves[i] = x
        return optree.tree_unflatten(spec, leaves)
    raise ValueError(
        f"sync_buffers: how must be 'mean' or 'broadcast', got {how!r}: 'broadcast' copies "
        "replica src's buffers (DDP's broadcast_buffers=True), 'mean' averages them."
    )
