"""Outputs of a step whose last all-reduces are still in flight (``overlap_steps=True``)."""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from fddp._base._errors import UsageTypeError, UsageValueError
from fddp._ranks import _runtime, _shutdown

_DONATED = object()  # a result handed to the next call's donated storage; it is gone
_PARAMETER_NEW = torch.nn.Parameter.__new__.__code__


class Deferred:
    """One call's deferred tail: what it needs, and its results once it has run."""

    def __init__(self, tail: Callable[[list], list], carried: list, key: Any, where: str) -> None:
        self.tail = tail
        self.carried: list | None = carried
        self.key = key  # the merged programs that can consume this tail are cached under it
        self.where = where
        self.results: list | None = None
        self.failure: BaseException | None = None
        self.lock = threading.RLock()  # one of complete() and the next call consumes the tail
        self.outputs: list[weakref.ref] = []  # its PendingTensors
        _live.add(self)

    @property
    def done(self) -> bool:
        return self.results is not None or self.failure is not None

    def complete(self) -> None:
        """Wait for the deferred all-reduces and run the updates that need them."""
        with self.lock:
            if self.done:
                return
            assert self.carried is not None
            with self.consuming(), _runtime.peer_failures(self.where):
                results = self.tail(self.carried)
            self.finish(results)

    @contextlib.contextmanager
    def consuming(self) -> Iterator[None]:
        """Run the tail (here, or inside the next call) once: if it fails part-way, what it
        carried may be half updated, so its outputs raise from then on."""
        try:
            yield
        except BaseException as e:
            self.failure, self.carried = e, None
            _live.discard(self)
            raise

    def finish(self, results: list) -> None:
        """Record results computed elsewhere (by the next call, which consumed the tail)."""
        self.results, self.carried = list(results), None
        _live.discard(self)

    def value(self, index: int) -> torch.Tensor:
        self.complete()
        if self.failure is not None:
            raise RuntimeError(
                f"this tensor is an output of {self.where} whose deferred updates failed "
                f"({type(self.failure).__name__}: {self.failure}); it has no value. Restart from "
                "the last checkpoint."
            ) from self.failure
        assert self.results is not None
        result = self.results[index]
        if result is _DONATED:
            raise UsageValueError(
                f"this tensor is an output of {self.where} that was passed to a donated "
                "argument of the next call (data_parallel(..., donate_argnums=...)): its "
                "storage now holds that call's result. Use the next call's output, or do not "
                "donate the argument."
            )
        return result


# Held until they run: a tail whose outputs were all dropped still has collectives in flight.
_live: set[Deferred] = set()


def complete_all() -> None:
    """Complete every deferred tail still pending (before the process group goes away)."""
    for deferred in list(_live):
        deferred.complete()


_shutdown.before_destroy("completing a pending step output", complete_all)


def complete_orphans() -> None:
    """Complete the tails none of whose outputs is referenced any more."""
    for deferred in list(_live):
        if all(ref() is None for ref in deferred.outputs):
            deferred.complete()


class PendingTensor(torch.Tensor):
    """A step output whose value is computed by a deferred tail (see the module docstring)."""

    _deferred: Deferred
    _index: int

    @staticmethod
    def __new__(cls, like: torch.Tensor, deferred: Deferred, index: int) -> PendingTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            like.shape,
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=like.dtype,
            device=like.device,
            requires_grad=False,
        )
        r._deferred, r._index = deferred, index
        deferred.outputs.append(weakref.ref(r))
        return r

    def __init__(self, like: torch.Tensor, deferred: Deferred, index: int) -> None:
        super().__init__()

    def wait(self) -> torch.Tensor:
        """The finished tensor (completing the deferred tail if it has not run)."""
        return self._deferred.value(self._index)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub omits func
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        args, kwargs = optree.tree_map(_finished, (args, kwargs or {}), none_is_leaf=True)
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return repr(self.wait())

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        return self.wait().numpy(*args, **kwargs)

    def tolist(self) -> Any:
        return self.wait().tolist()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.wait().__reduce_ex__(protocol)

    # What reads a tensor's memory without an operator (the wrapper has none of its own): the
    # finished tensor's, so the value is completed first.

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return copy.deepcopy(self.wait(), memo)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wait().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.wait().__dlpack_device__()

    def data_ptr(self) -> int:
        return self.wait().data_ptr()

    def share_memory_(self) -> PendingTensor:
        """Complete the value and move it to shared memory (what the wrapper stands for)."""
        self.wait().share_memory_()
        return self

    def is_shared(self) -> bool:
        return self.wait().is_shared()

    def detach(self) -> torch.Tensor:
        if sys._getframe(1).f_code is _PARAMETER_NEW:
            # nn.Parameter(x) keeps x itself when x is a tensor subclass, which would leave a
            # module holding a wrapper that completes on every use
            raise UsageTypeError(
                f"torch.nn.Parameter(x): x is an output of {self._deferred.where} whose last "
                "updates are still pending (data_parallel(..., overlap_steps=True)). Pass "
                "fddp.block_until_ready(x), the finished tensor, instead."
            )
        return self.wait().detach()


def is_pending(x: Any) -> bool:
    return isinstance(x, PendingTensor)


def _finished(x: Any) -> Any:
    return x.wait() if isinstance(x, PendingTensor) else x


def finished(tree: Any) -> Any:
    """``tree`` with every pending leaf replaced by its finished tensor."""
    if not any(map(is_pending, optree.tree_leaves(tree, none_is_leaf=True))):
        return tree
    return optree.tree_map(_finished, tree, none_is_leaf=True)


def block_until_ready(tree: Any) -> Any:
    """Wait for every output of an ``overlap_steps=True`` step in ``tree`` and return the tree
    with them finished (plain tensors); other leaves are returned as they are.

    Like ``jax.block_until_ready``: for timing a step, or before handing its outputs to code
    that inspects tensor types. Touching a pending output completes it anyway.

    >>> import fddp, torch
    >>> fddp.block_until_ready({"w": torch.ones(2)})
    {'w': tensor([1., 1.])}
    """
    return finished(tree)
