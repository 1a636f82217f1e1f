"""A loss that says how it is normalised over the global batch: a weighted mean or a sum."""

from __future__ import annotations

import dataclasses

import torch

from fddp._base._errors import UsageTypeError, UsageValueError


@dataclasses.dataclass(frozen=True, eq=False)  # tensors have no truth value to compare by
class Loss:
    """A loss as a sum and what to divide it by, so that it is normalised over the global batch.

    Return one from the function ``fddp.value_and_grad`` (or ``fddp.grad``,
    ``fddp.accumulate_gradients``) differentiates, instead of a scalar, and the value and the
    gradient are those of the loss over the global batch: the sum of ``total`` over every
    rank, micro-batch, invariant chunk and ``fddp.vmap`` replica, divided by the sum of
    ``weight`` over the same (:meth:`mean`), or not divided (:meth:`sum`). They come back
    already reduced, the same on every replica, so the step's usual ``fddp.pmean(grads)`` and
    ``fddp.pmean(loss)`` return them as they are. A plain scalar loss is taken as a mean over
    the batch's examples (rows): the mean of per-rank means, as in DDP, which is the global
    mean only when every rank holds as many examples.

    Build it with :meth:`mean` or :meth:`sum`.

    Attributes:
        total: the loss summed over this call's batch (e.g. per-token losses times the
            padding mask, summed): a 0-d floating-point tensor.
        weight: what the global sum is divided by, summed like ``total``: the number of
            valid tokens, or the summed example weights (a 0-d tensor or a number, never
            differentiated); None for a sum.

    Example:
        >>> import fddp, torch
        >>> per_token = torch.tensor([[2.0, 4.0], [6.0, 0.0]])
        >>> mask = torch.tensor([[1, 1], [1, 0]])
        >>> loss = fddp.Loss.mean((per_token * mask).sum(), mask.sum())
        >>> loss.value()
        tensor(4.)
    """

    total: torch.Tensor
    weight: torch.Tensor | None

    def __post_init__(self) -> None:
        total = self.total
        if not (isinstance(total, torch.Tensor) and total.dim() == 0):
            raise UsageTypeError(
                f"fddp.Loss: total must be a 0-d tensor (the loss summed over the batch); "
                f"got {_described(total)}. Sum the per-example or per-token losses: "
                "fddp.Loss.mean(losses.sum(), weight)."
            )
        if not total.is_floating_point():
            raise UsageTypeError(
                f"fddp.Loss: total has dtype {total.dtype}; a loss needs floating point."
            )
        weight = self.weight
        if weight is None:
            return
        if isinstance(weight, (int, float)) and not isinstance(weight, bool):
            dtype = torch.int64 if isinstance(weight, int) else torch.float64
            weight = torch.tensor(weight, dtype=dtype, device=total.device)
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 0):
            raise UsageTypeError(
                f"fddp.Loss: weight must be a number or a 0-d tensor (the count of valid "
                f"tokens or the summed weights); got {_described(weight)}."
            )
        if weight.is_complex():
            raise UsageTypeError("fddp.Loss: weight must be real.")
        object.__setattr__(self, "weight", weight.detach())

    @classmethod
    def mean(cls, total: torch.Tensor, weight: torch.Tensor | float) -> Loss:
        """A mean: ``total`` summed over the global batch, divided by ``weight`` summed over it.

        For a mean over the valid tokens: ``Loss.mean((per_token * mask).sum(), mask.sum())``;
        over weighted examples: ``Loss.mean((w * per_example).sum(), w.sum())``; over rows
        of a padded batch (``fddp.data.pad_rows``): ``Loss.mean((mask * per_row).sum(),
        mask.sum())``.

        >>> import fddp, torch
        >>> fddp.Loss.mean(torch.tensor(6.0), 4).value()
        tensor(1.5000)
        """
        if weight is None:
            raise UsageValueError(
                "fddp.Loss.mean: weight is None; give the count or summed weights the total is "
                "divided by, or use fddp.Loss.sum(total) for a sum."
            )
        return cls(total, weight)  # type: ignore[arg-type]  # __post_init__ makes it a tensor

    @classmethod
    def sum(cls, total: torch.Tensor) -> Loss:
        """A sum: ``total`` summed over the global batch, not divided.

        >>> import fddp, torch
        >>> fddp.Loss.sum(torch.tensor(6.0)).value()
        tensor(6.)
        """
        return cls(total, None)

    def value(self) -> torch.Tensor:
        """This loss on its own batch: ``total / weight``, or ``total`` for a sum."""
        if self.weight is None:
            return self.total
        return self.total / self.weight.to(self.total.dtype)


def kind(value: object) -> str:
    """How a differentiated function's value is normalised: ``"mean"`` or ``"sum"`` for a
    :class:`Loss`, ``"example"`` for anything else (a scalar: a mean over examples)."""
    if isinstance(value, Loss):
        return "sum" if value.weight is None else "mean"
    return "example"


KINDS = {
    "example": "a scalar (a mean over examples)",
    "mean": "an fddp.Loss.mean",
    "sum": "an fddp.Loss.sum",
}


def mixed_kinds_error(where: str, first: str, other: str, what: str) -> UsageValueError:
    return UsageValueError(
        f"{where}: the loss is {KINDS[first]} for one {what} and {KINDS[other]} for another; "
        f"return the same kind for every {what}."
    )


def _described(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    return type(x).__name__
