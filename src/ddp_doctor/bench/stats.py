"""The bench's verdict: a winner only when the measurement clearly shows one, else the config that does least work.

Method. Candidates run in the same rounds, so each round gives one paired ratio: candidate's median step time over
the reference's. The reference is the correct candidate that does the least work by construction (`work_rank`).
The median of the paired ratios gets a 95% bootstrap percentile interval (2,000 resamples, a fixed seed, so the same
timings always give the same verdict). A candidate beats the reference only when the whole interval lies below
`1 - MARGIN`: faster by more than the margin in every plausible reading of the rounds. Otherwise the two are
"indistinguishable here" and the reference, which does less work, is kept. With fewer than `MIN_ROUNDS` rounds
nothing can be shown and the reference stands.

Pure: no torch, no processes. Tested on synthetic timings.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ddp_doctor.bench.candidates import Config

__all__ = ["MARGIN", "MIN_ROUNDS", "Comparison", "Verdict", "compare", "decide", "work_rank", "work_reason"]

MARGIN = 0.03
"""A candidate must be at least 3% faster than the least-work one, with the whole interval, to be preferred."""
MIN_ROUNDS = 3
"""Below this many paired rounds an interval says nothing (with 2 rounds it is just their range)."""
_RESAMPLES = 2000
_SEED = 20261122


def work_rank(config: Config) -> int:
    """Work DDP does per step by construction, lower is less: freeze before wrap (fewer parameters reduced), then
    both flags off, then static_graph=True (one graph walk at the first step), then find_unused_parameters=True
    (a walk of the autograd graph every step)."""
    if config.find_unused_parameters:
        return 3
    if config.static_graph:
        return 2
    return 0 if config.freeze_before_wrap else 1


def work_reason(config: Config) -> str:
    return (
        "freezes the never-used parameters, so DDP reduces fewer tensors",
        "skips the graph walk",
        "walks the graph once, at the first step",
        "walks the autograd graph every step",
    )[work_rank(config)]


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """A candidate's step time over the reference's, paired by round."""

    ratio: float | None
    """Median of the paired per-round ratios (None without a paired round)."""
    low: float | None
    high: float | None
    """95% bootstrap interval of that median (None below `MIN_ROUNDS` rounds)."""
    rounds: int

    @property
    def faster(self) -> bool:
        """Clearly faster than the reference: the whole interval below 1 - MARGIN."""
        return self.high is not None and self.high < 1 - MARGIN

    @property
    def settled(self) -> bool:
        """More rounds would not change whether it is clearly faster: the interval lies on one side of 1 - MARGIN."""
        return self.low is not None and (self.high < 1 - MARGIN or self.low > 1 - MARGIN)

    def describe(self) -> str:
        if self.ratio is None:
            return "no paired round"
        if self.low is None:
            return f"median ratio {self.ratio:.2f} over {self.rounds} round(s): too few rounds for an interval"
        return (
            f"median ratio {self.ratio:.2f}, 95% interval {self.low:.2f} to {self.high:.2f} over {self.rounds} rounds"
        )


def compare(candidate: Sequence[float], reference: Sequence[float]) -> Comparison:
    """Compare per-round median step times of two candidates that ran in the same rounds."""
    ratios = [a / b for a, b in zip(candidate, reference) if b > 0]
    if not ratios:
        return Comparison(ratio=None, low=None, high=None, rounds=0)
    ratio = statistics.median(ratios)
    if len(ratios) < MIN_ROUNDS:
        return Comparison(ratio=ratio, low=None, high=None, rounds=len(ratios))
    rng = random.Random(_SEED)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(_RESAMPLES))
    low, high = medians[int(0.025 * _RESAMPLES)], medians[int(0.975 * _RESAMPLES) - 1]
    return Comparison(ratio=ratio, low=low, high=high, rounds=len(ratios))


@dataclass(frozen=True, kw_only=True)
class Verdict:
    choice: str
    """The chosen candidate's name."""
    reference: str
    """The least-work correct candidate every other one was compared with."""
    comparisons: dict[str, Comparison]
    """Each other correct candidate against the reference."""
    measured: bool
    """True when the choice was made because the measurement clearly showed it faster."""
    settled: bool
    """True when more rounds would not change the choice."""
    reason: str
    """One line a user can check."""


def decide(rounds: dict[str, list[float]], configs: dict[str, Config]) -> Verdict | None:
    """Pick among the correct candidates. `rounds[name]` are per-round median step times, in the same round order
    for every candidate; `configs[name]` their configurations. None when there is no candidate."""
    if not rounds:
        return None
    order = sorted(rounds, key=lambda n: (work_rank(configs[n]), list(rounds).index(n)))
    reference = order[0]
    comparisons = {n: compare(rounds[n], rounds[reference]) for n in order[1:]}
    faster = {n: c for n, c in comparisons.items() if c.faster}
    settled = all(c.settled for c in comparisons.values())
    ref_cfg = configs[reference]
    if faster:
        choice = min(faster, key=lambda n: faster[n].ratio or 1.0)
        c = faster[choice]
        reason = (
            f"{choice} vs {reference}: {c.describe()}: clearly faster (the whole interval is below "
            f"{1 - MARGIN:.2f}), although {reference} does less work ({work_reason(ref_cfg)})."
        )
        return Verdict(
            choice=choice, reference=reference, comparisons=comparisons, measured=True, settled=settled, reason=reason
        )
    if comparisons:
        name, c = min(comparisons.items(), key=lambda kv: kv[1].ratio if kv[1].ratio is not None else 9.9)
        how = "slower" if c.low is not None and c.low > 1 + MARGIN else "indistinguishable here"
        reason = f"{name} vs {reference}: {c.describe()}: {how}; choosing {reference}, which {work_reason(ref_cfg)}."
    else:
        reason = f"{reference} is the only correct candidate."
    return Verdict(
        choice=reference, reference=reference, comparisons=comparisons, measured=False, settled=settled, reason=reason
    )
