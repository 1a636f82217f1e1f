"""Draws from Python's and numpy's random generators while a step is traced, and where."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from fddp._compiler._capture import _user_frames

# methods every draw of a random.Random goes through, and those that set its state
_PRIMITIVES = ("random", "getrandbits")
_SEEDS = ("seed", "setstate")
_NUMPY_SEEDS = ("seed", "set_state")


@dataclasses.dataclass
class Draws:
    """The generators drawn from before the traced code seeded them: (generator, where)."""

    seeded: set[int] = dataclasses.field(default_factory=set)
    found: list[tuple[str, traceback.FrameSummary | None]] = dataclasses.field(default_factory=list)

    def note(self, generator: Any, what: str) -> None:
        if id(generator) not in self.seeded and not self.found:
            frames = traceback.extract_stack()[:-2]
            self.found.append((what, _user_frames.user_frame(frames)))


@contextlib.contextmanager
def watched() -> Iterator[Draws]:
    """Within the block, this thread's draws from ``random.Random`` generators (the module's
    functions and any instance) and from numpy's global generator are noted, unless the
    generator was seeded (or made) within the block first: a trace runs the step's Python once,
    so such a draw would be one number frozen into the program."""
    draws = Draws()
    thread = threading.get_ident()
    undo: list[Callable[[], None]] = []

    def patch(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        original = getattr(owner, name)
        own = name in vars(owner)  # a class's, not inherited: put back; else removed
        setattr(owner, name, wrapper(original))
        undo.append(lambda: setattr(owner, name, original) if own else delattr(owner, name))

    def drawing(generator: Callable[[Any], Any], what: str) -> Callable[[Any], Any]:
        def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            def draw(*args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() == thread:
                    draws.note(generator(args), what)
                return original(*args, **kwargs)

            return draw

        return wrapper

    def seeding(generator: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            def seed(*args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() == thread:
                    draws.seeded.add(id(generator(args)))
                return original(*args, **kwargs)

            return seed

        return wrapper

    module_generator = random._inst
    try:
        for name in _PRIMITIVES:  # instances: every method draws through these
            patch(random.Random, name, drawing(lambda a: a[0], f"random.Random.{name}"))
        for name in _SEEDS:
            patch(random.Random, name, seeding(lambda a: a[0]))
        for name in _PRIMITIVES:  # the module's own, bound to its generator at import
            patch(random, name, drawing(lambda a: module_generator, f"random.{name}"))
        for name in _SEEDS:
            patch(random, name, seeding(lambda a: module_generator))
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            _patch_numpy(numpy.random, patch, drawing, seeding)
        yield draws
    finally:
        for step in reversed(undo):
            step()


def _patch_numpy(module: Any, patch: Callable, drawing: Callable, seeding: Callable) -> None:
    """numpy's module functions are methods of one hidden ``RandomState``."""
    hidden = getattr(module.mtrand, "_rand", None)
    if hidden is None:
        return
    for name in dir(module):
        function = getattr(module, name)
        if getattr(function, "__self__", None) is not hidden:
            continue
        if name in _NUMPY_SEEDS:
            patch(module, name, seeding(lambda a: hidden))
        elif name not in ("get_state", "get_bit_generator"):
            patch(module, name, drawing(lambda a: hidden, f"numpy.random.{name}"))


def message(draws: Draws) -> str | None:
    """The error for the first draw noted, None without one."""
    if not draws.found:
        return None
    what, frame = draws.found[0]
    return (
        f"fddp.data_parallel: the step draws from a Python random generator ({what}) while "
        f"it is traced{_user_frames.where(frame)}\n"
        "A traced step runs its Python once: that draw would be one number frozen into the "
        "program, the same on every call, where the step run eagerly draws a new one each "
        "time. Draw with torch instead (torch.rand, torch.randn, torch.randint: the program "
        "draws them anew on every call), or draw in Python outside the step and pass the "
        "value in as a tensor; seeding the generator inside the step (random.seed(0)) makes "
        "its draws the same on every call, which a trace keeps. trace=False runs the step "
        "eagerly."
    )
