"""How large a bucket of collectives is, and which leaves share one: the one bucket rule."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence

from fddp._ranks._machine import Machine

MIB = 2**20
DDP_CAP_BYTES = 25 * MIB
FIRST_CAP_BYTES = MIB  # DDP's first bucket, and shard_state's smallest
_FRACTION = 16
_LATENCIES_PER_BUCKET = 5
_RESOLUTION = 0.05  # predictions closer than this are not told apart
_CANDIDATE_CAPS = tuple(int(m * MIB) for m in (0.25, 0.5, 1, 2, 4, 8, 16, 25, 64, 128, 256))

Predict = Callable[[int], float]  # a cap -> the predicted seconds of the step


def rule_of_thumb(total: int, first: int, machine: Machine | None = None) -> int:
    """A sixteenth of ``total`` bytes within [``first``, 25 MiB]; with a measured ``machine``,
    no smaller than five latencies' worth of transfer (nor than that in all, ``total``).

    A sixteenth makes about 8 to 16 buckets (a bucket closes once it reaches the cap). The
    latency floor may exceed 25 MiB: a ring all-reduce over many ranks pays its latency per
    rank, so on 1,024 ranks a 25 MiB bucket is mostly latency.

    >>> rule_of_thumb(32 * MIB, MIB) == 2 * MIB
    True
    """
    cap = min(DDP_CAP_BYTES, max(first, total // _FRACTION))
    if machine is not None:
        floor = int(_LATENCIES_PER_BUCKET * machine.latency / machine.seconds_per_byte)
        cap = max(cap, min(floor, total))
    return cap


def candidates(total: int, first: int) -> list[int]:
    """The caps worth predicting: up to the one that puts everything after the first bucket
    in one bucket."""
    caps = {max(first, c) for c in _CANDIDATE_CAPS if c < total}
    caps.add(max(first, total))
    return sorted(caps)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A cap and the sentence that says where it came from (``schedule()`` prints it)."""

    cap: int
    source: str

    def __str__(self) -> str:
        return f"bucket cap {self.cap / MIB:.3g} MiB, {self.source}"


@dataclasses.dataclass(frozen=True)
class CapPolicy:
    """The cap of the buckets after the first: ``fixed`` bytes (``bucket_cap_mb``), or, when
    None, the rule of thumb, which the cost model may overrule where the link is measured:
    only where its predictions differ by more than its resolution (5 %), and then the cap
    nearest the rule of thumb among those within 5 % of the fastest wins."""

    fixed: int | None
    first: int

    def measures(self, world: int) -> bool:
        """Whether choosing needs the link and compute measured (a collective, the first time)."""
        return self.fixed is None and world > 1

    def choose(
        self, total: int, machine: Machine | None = None, predict: Predict | None = None
    ) -> Choice:
        """The cap for buckets of ``total`` bytes in all; ``predict`` (given with ``machine``)
        is the cost model's prediction of the step's seconds for a cap."""
        if self.fixed is not None:
            return Choice(self.fixed, "set by bucket_cap_mb")
        preferred = rule_of_thumb(total, self.first, machine)
        if machine is None or predict is None:
            return Choice(preferred, "a sixteenth of the gradient bytes")
        predicted = {c: predict(c) for c in sorted({*candidates(total, self.first), preferred})}
        fastest = min(predicted.values())
        near = [c for c, s in predicted.items() if s <= fastest * (1 + _RESOLUTION)]
        cap = min(near, key=lambda c: abs(math.log(c / preferred)))
        table = ", ".join(f"{c / MIB:.4g} MiB {s / fastest:.3f}" for c, s in predicted.items())
        return Choice(
            cap,
            f"chosen by the cost model from {machine} (predicted step "
            f"{predicted[cap] * 1e3:.1f} ms; relative to the fastest: {table}; rule of thumb "
            f"{preferred / MIB:.3g} MiB)",
        )


def pack(
    nbytes: Sequence[int],
    keys: Sequence[Hashable],
    cap: int,
    *,
    first_cap: int | None = None,
    crossing_joins: bool = True,
    ready: Sequence[int] | None = None,
    first_use: Sequence[int] | None = None,
) -> list[list[int]]:
    """Items taken in order into buckets of one key each: which items share a bucket.

    An open bucket of a key takes that key's next item while it holds fewer than ``cap`` bytes
    (``first_cap`` for the key's first bucket), so the item that crosses the cap still joins
    it: no bucket is left holding a few biases while a large weight starts the next (DDP's
    rule). Otherwise the bucket closes and the item opens the next one.

    Args:
        nbytes: each item's bytes.
        keys: each item's key (dtype, device, process group, ...): a bucket holds one key.
        cap: bytes after which a bucket takes no more items.
        first_cap: the cap of each key's first bucket (None: ``cap``).
        crossing_joins: False: an item joins only if the bucket then holds at most ``cap``
            bytes, so a bucket exceeds the cap only when one item alone does. For a flat copy
            made outside any schedule (eager collectives), whose peak memory the cap bounds.
        ready, first_use: with both, an item joins only if it is ready before every member's
            result is first needed (positions in a program), so that merging the members'
            collectives into one cannot make a cycle.

    Returns:
        The buckets, each a list of item indices in order, in the order they close (when the
        next item of their key does not join; the rest at the end, in the order they opened).

    >>> pack([4, 4, 4, 8, 4], ["f", "f", "f", "i", "f"], cap=6)
    [[0, 1], [2, 4], [3]]
    >>> pack([4, 4, 4, 8, 4], ["f", "f", "f", "i", "f"], cap=6, crossing_joins=False)
    [[0], [1], [2], [4], [3]]
    """
    opened: dict[Hashable, tuple[list[int], int, float]] = {}
    done: list[list[int]] = []
    past_first: set[Hashable] = set()  # keys whose first bucket is closed
    for i, (size, key) in enumerate(zip(nbytes, keys, strict=True)):
        needed = math.inf if first_use is None else first_use[i]
        if key in opened:
            bucket, used, deadline = opened[key]
            limit = cap if first_cap is None or key in past_first else first_cap
            fits = used < limit if crossing_joins else used + size <= limit
            if fits and (ready is None or ready[i] < deadline):
                bucket.append(i)
                opened[key] = (bucket, used + size, min(deadline, needed))
                continue
            done.append(bucket)
            past_first.add(key)
        opened[key] = ([i], size, needed)
    done.extend(bucket for bucket, _, _ in opened.values())
    return done
