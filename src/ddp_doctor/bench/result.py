"""What `ddp-doctor bench` found: every candidate's rounds, the launches it took, the verdict. Rendered by
`cli/bench.py` (text) and `bench/page.py`; `to_dict` is the JSON contract (schema `ddp-doctor/bench@1`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ddp_doctor.analyze import with_code
from ddp_doctor.bench.candidates import Config
from ddp_doctor.bench.launched import LaunchResult
from ddp_doctor.bench.plan import judge_report, unused_of
from ddp_doctor.bench.stats import Comparison, Verdict
from ddp_doctor.core.findings import Recommendation
from ddp_doctor.report.model import Report

__all__ = ["SCHEMA", "BenchResult", "Candidate", "Launch", "judge"]

SCHEMA = "ddp-doctor/bench@1"


@dataclass(kw_only=True)
class Candidate:
    """One configuration and what its runs showed."""

    name: str
    config: Config
    correct: bool = True
    reason: str = ""
    rounds: list[list[float]] = field(default_factory=list)
    """Per round, the timed step durations (seconds)."""

    @property
    def steps(self) -> list[float]:
        return [t for r in self.rounds for t in r]

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.steps) if self.correct and self.steps else None

    @property
    def spread(self) -> float | None:
        """Interquartile range of the step times, relative to their median."""
        steps = self.steps
        if not self.correct or len(steps) < 2:
            return None
        q1, _, q3 = statistics.quantiles(steps, n=4)
        return (q3 - q1) / statistics.median(steps)

    def round_medians(self) -> list[float]:
        return [statistics.median(r) for r in self.rounds if r]


@dataclass(kw_only=True)
class Launch:
    """One start of the script under torchrun."""

    index: int
    why: str
    """Why this launch was needed: the first runs the check, a later one says why the previous could not go on."""
    blocks: list[str] = field(default_factory=list)
    """The blocks that ran in it, as "name (round r)"."""
    ended: str = ""
    """Why it ended."""
    startup_s: float | None = None
    """From the start of the launch to the script's first optimizer step: what the script's start-up costs."""
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "why": self.why,
            "blocks": self.blocks,
            "ended": self.ended,
            "startup_s": self.startup_s,
            "wall_s": self.wall_s,
        }


@dataclass(kw_only=True)
class BenchResult:
    """The bench's outcome: the baseline check, every candidate, and the winner."""

    check: Report
    candidates: list[Candidate]
    winner: Candidate | None
    decision: Verdict | None = None
    rounds_run: int = 0
    stopped: str = ""
    """Why the rounds stopped: the verdict was settled, the maximum was reached, or the budget ran out."""
    launches: list[Launch] = field(default_factory=list)

    @property
    def startup_s(self) -> float | None:
        """The script's start-up (launch to first optimizer step), the median over the launches that measured it."""
        known = [launch.startup_s for launch in self.launches if launch.startup_s is not None]
        return statistics.median(known) if known else None

    @property
    def blocks(self) -> int:
        return sum(len(launch.blocks) for launch in self.launches)

    def comparison(self, candidate: Candidate) -> Comparison | None:
        """The candidate against the least-work reference (None for the reference itself)."""
        return self.decision.comparisons.get(candidate.name) if self.decision is not None else None

    def ratio_to(self, candidate: Candidate, other: Candidate | None) -> float | None:
        a, b = candidate.median_step_s, other.median_step_s if other is not None else None
        return a / b if a is not None and b else None

    @property
    def user(self) -> Candidate | None:
        return next((c for c in self.candidates if c.name == "user"), None)

    def verdict(self) -> Recommendation | None:
        """The winner as a recommendation, rendered for torch, transformers, accelerate and lightning."""
        if self.winner is None:
            return None
        c = self.winner.config
        assert self.decision is not None
        head = (
            "Measured fastest correct configuration"
            if self.decision.measured
            else "Correct configuration that does the least work"
        )
        rec = Recommendation(
            find_unused_parameters=c.find_unused_parameters,
            static_graph=c.static_graph,
            gradient_as_bucket_view=c.gradient_as_bucket_view,
            freeze_before_wrap=list(c.freeze_before_wrap),
            verified=True,
            reason=f"{head} ({self.winner.name}). {self.decision.reason} Rounds: {self.rounds_run} ({self.stopped}).",
        )
        return with_code(rec, {**self.check.ddp_config, "bucket_cap_mb": c.bucket_cap_mb})

    def to_dict(self) -> dict[str, Any]:
        best = self.winner
        return {
            "schema": SCHEMA,
            "candidates": [
                {
                    "name": c.name,
                    "config": c.config.to_dict(),
                    "correct": c.correct,
                    "reason": c.reason,
                    "median_step_s": c.median_step_s,
                    "spread": c.spread,
                    "ratio_to_user": self.ratio_to(c, self.user),
                    "ratio_to_best": self.ratio_to(c, best),
                    "vs_reference": None
                    if (cmp := self.comparison(c)) is None
                    else {"median_ratio": cmp.ratio, "low": cmp.low, "high": cmp.high, "rounds": cmp.rounds},
                    "rounds": c.rounds,
                }
                for c in self.candidates
            ],
            "winner": None
            if best is None
            else {
                "name": best.name,
                "config": best.config.to_dict(),
                "reference": self.decision.reference if self.decision else None,
                "measured": self.decision.measured if self.decision else False,
                "reason": self.decision.reason if self.decision else "",
            },
            "rounds_run": self.rounds_run,
            "stopped": self.stopped,
            "startup_s": self.startup_s,
            "launches": [launch.to_dict() for launch in self.launches],
            "check": self.check.to_dict(),
        }


def judge(result: LaunchResult, config: Config, baseline: Report, timed_steps: int) -> tuple[bool, str]:
    """Whether a candidate whose block was the first of its launch (observed by the session's own doctor) was
    correct, from the launch's result, and why not."""
    check = result.check
    if check.error is not None:
        return False, check.error.splitlines()[0]
    report = check.report
    assert report is not None
    correct, reason = judge_report(report, config, unused_of(baseline), [m.report for m in check.models[1:]])
    if correct and result.late_crash:
        return False, f"crashed after the observed steps: {result.late_crash}"
    if correct and not result.step_times:
        return False, f"no step was timed (the script ended before {timed_steps} more steps)"
    return correct, reason
