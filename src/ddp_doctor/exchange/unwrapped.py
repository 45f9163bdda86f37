"""The exchange of a run whose model no data-parallel wrapper holds (`model-not-wrapped`: the check followed the
optimizer that trains on several ranks): whether every rank steps the same number of parameters, and which of them
differ across the ranks. Two MAX rounds whose shapes depend on the parameters only (the second only when the ranks
step the same number), whatever the world size; `simulate.lockstep` runs them for 1,024 ranks."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ddp_doctor.exchange.packing import Op, Reply
from ddp_doctor.exchange.primitives import minmax_rounds

__all__ = ["UnwrappedCompared", "unwrapped_rounds"]


@dataclass(frozen=True, slots=True)
class UnwrappedCompared:
    """What every rank agrees on about the parameters the followed optimizer steps."""

    differ: list[bool]
    """Per parameter of this rank: its fingerprint differs across the ranks (all True when the ranks step different
    numbers of parameters: nothing to pair them by)."""
    gap: float
    """The largest difference of a fingerprint's component across the ranks (inf when the counts differ)."""
    dtensors: int
    """The most DTensor parameters any rank steps (left out of the comparison: their parallelism keeps them)."""


def unwrapped_rounds(
    count: int, dtensors: int, fingerprints: Callable[[], torch.Tensor]
) -> Generator[Op, Reply, UnwrappedCompared]:
    """This rank's side: it steps `count` plain parameters and `dtensors` DTensor ones; `fingerprints` gives the
    plain ones' fingerprints (`core.fingerprint.fingerprints_batched`, count x K), computed only when every rank
    steps as many."""
    top, low = yield from minmax_rounds(torch.tensor([float(count), float(dtensors)]))
    if top[0].item() != low[0].item():
        return UnwrappedCompared(differ=[True] * count, gap=float("inf") if count else 0.0, dtensors=int(top[1]))
    fp = fingerprints().nan_to_num(0.0)
    high, lowest = yield from minmax_rounds(fp)
    gap = (high - lowest).abs().amax(-1)
    return UnwrappedCompared(
        differ=(high != lowest).any(-1).tolist(), gap=float(gap.max()) if count else 0.0, dtensors=int(top[1])
    )
