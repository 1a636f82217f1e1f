"""How large a bucket of collectives is: one policy for data_parallel's all-reduces and for
shard_state's reduce-scatters and all-gathers.

A cap set by the user is used as it is. The default, the rule of thumb, is a sixteenth of all
the bytes to reduce, within [the first bucket's cap, DDP's 25 MiB], which makes about 8 to 16
buckets (a bucket closes once it reaches the cap). Where the link has been measured it is also
no smaller than a bucket whose transfer takes five link latencies, above 25 MiB too (a ring
all-reduce over many ranks pays its latency per rank: on 1,024 ranks a 25 MiB bucket is mostly
latency), and a cost model may overrule it: only where its predictions differ by more than the
model's resolution (5 %), and then the cap nearest the rule of thumb among those within 5 % of
the fastest wins.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from fddp._machine import Machine

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

    Measured with 2 gloo ranks behind a 5 Gbit/s link (benchmarks/): 8-layer MLP, 33 MB of
    gradients, nine 4 MiB buckets 144-175 ms a step against 199-236 ms with 25 MiB ones; on
    plain loopback the two were within noise.
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
    None, the rule of thumb, which the cost model may overrule where the link is measured."""

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
