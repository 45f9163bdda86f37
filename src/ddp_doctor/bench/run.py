"""Run the candidates interleaved in rounds, judge each run's correctness, and pick the fastest correct one.

Each run is a `check` with the candidate's DDP arguments: the doctor observes the first K steps (that is the
correctness check: no error finding, gradients identical across ranks at every optimizer step, the same used set
as the baseline check), then removes every hook and times K more optimizer steps. Only those unobserved steps are
timed.

"Within noise": candidates A and B run in the same rounds, so each round gives one ratio of their median step
times. A is within noise of B when the median of those ratios is closer to 1 than half their range (the rounds
disagree with each other by more than the gap between A and B; this covers rounds that disagree about which one
is faster), or within 2% of 1.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.bench.candidates import Config, candidates
from ddp_doctor.launch.outcome import CheckResult
from ddp_doctor.launch.supervise import check_namespace
from ddp_doctor.report.model import Recommendation, Report
from ddp_doctor.report.snippets import render_snippets

__all__ = ["NOISE_FLOOR", "BenchResult", "Candidate", "run_bench"]

NOISE_FLOOR = 0.02
"""Median ratios within this of 1 are treated as a tie, whatever the rounds say."""
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
class BenchResult:
    """The bench's outcome: the baseline check, every candidate, and the winner."""

    check: Report
    candidates: list[Candidate]
    winner: Candidate | None
    within_noise: list[Candidate]

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
        gain = self.ratio_to(self.user, self.winner) if self.user is not None else None
        rec = Recommendation(
            find_unused_parameters=c.find_unused_parameters, static_graph=c.static_graph,
            gradient_as_bucket_view=c.gradient_as_bucket_view, freeze_before_wrap=list(c.freeze_before_wrap),
            verified=True,
            reason=(f"Fastest correct configuration ({self.winner.name})"
                    + (f": the script's own configuration takes {gain:.2f}x its step time" if gain else "")
                    + (f"; within noise of {', '.join(c.name for c in self.within_noise)}"
                       if self.within_noise else "") + "."))
        rec.render = render_snippets(rec, {**self.check.ddp_config, "bucket_cap_mb": c.bucket_cap_mb})
        return rec

    def to_dict(self) -> dict[str, Any]:
        best = self.winner
        return {
            "schema": SCHEMA,
            "candidates": [{
                "name": c.name, "config": c.config.to_dict(), "correct": c.correct, "reason": c.reason,
                "median_step_s": c.median_step_s, "spread": c.spread,
                "ratio_to_user": self.ratio_to(c, self.user), "ratio_to_best": self.ratio_to(c, best),
                "rounds": c.rounds,
            } for c in self.candidates],
            "winner": None if best is None else {
                "name": best.name, "config": best.config.to_dict(),
                "within_noise_of": [c.name for c in self.within_noise]},
            "check": self.check.to_dict(),
        }


def _unused(report: Report) -> set[str]:
    found = report.finding("unused-parameters")
    return set(found.param_names) if found else set()


def judge(result: CheckResult, config: Config, baseline: Report, timed_steps: int) -> tuple[bool, str]:
    """Whether one run of a candidate was correct, and why not."""
    if result.error is not None:
        return False, result.error.splitlines()[0]
    report = result.report
    assert report is not None
    errors = [f for f in report.findings if f.severity == "error"]
    if errors:
        return False, f"{', '.join(f.code for f in errors)} ({errors[0].title})"
    if result.late_crash:
        return False, f"crashed after the observed steps: {result.late_crash}"
    expected = _unused(baseline) - set(config.freeze_before_wrap)
    if _unused(report) - set(config.freeze_before_wrap) != expected:
        return False, (f"the used set differs from the check's: unused {sorted(_unused(report))}, "
                       f"expected {sorted(expected)}")
    if not result.step_times:
        return False, f"no step was timed (the script ended before {timed_steps} more steps)"
    return True, ""


def run_bench(namespace: dict[str, Any], *, steps: int, rounds: int, timeout: float, log_dir: Path,
              only: list[str] | None = None,
              on_progress: Callable[[str], None] | None = None) -> BenchResult:
    """Check the script once, then run every candidate `rounds` times, interleaved.

    Args:
        namespace: torchrun's parsed namespace for the script (as a dict).
        steps: K: optimizer steps observed for correctness, then K more timed, per run.
        rounds: how many times each candidate runs.
        timeout: per run, in seconds.
        log_dir: the script's output of every run goes to a file here.
        only: candidate names to keep (default: all).
        on_progress: called before each run with a description.
    """
    def run(name: str, config: Config | None, timed: int) -> CheckResult:
        if on_progress is not None:
            on_progress(name)
        kwargs = config.ddp_kwargs if config is not None else {}
        freeze = list(config.freeze_before_wrap) if config is not None else []
        with open(log_dir / f"{name.replace(' ', '_')}.log", "a") as log:
            return check_namespace(namespace, steps=steps, ddp_kwargs=kwargs, freeze=freeze, timeout=timeout,
                                   output=log, timed_steps=timed)

    first = run("check", None, 0)
    if first.report is None:
        raise RuntimeError(first.error or "the check produced no report")
    baseline = first.report
    cands = [Candidate(name=n, config=c) for n, c in candidates(baseline) if only is None or n in only]
    for _ in range(rounds):
        for cand in cands:
            if not cand.correct:
                continue    # a candidate is incorrect once: it is never timed as a winner
            result = run(cand.name, cand.config, steps)
            cand.correct, cand.reason = judge(result, cand.config, baseline, steps)
            if cand.correct:
                cand.rounds.append(list(result.step_times or []))
    correct = [c for c in cands if c.correct and c.median_step_s is not None]
    winner = min(correct, key=lambda c: c.median_step_s or 0.0, default=None)
    noise = [c for c in correct if c is not winner and winner is not None and _within_noise(c, winner)]
    return BenchResult(check=baseline, candidates=cands, winner=winner, within_noise=noise)


def _within_noise(a: Candidate, b: Candidate) -> bool:
    ratios = [x / y for x, y in zip(a.round_medians(), b.round_medians()) if y]
    if not ratios:
        return True
    gap = abs(statistics.median(ratios) - 1.0)
    return gap <= NOISE_FLOOR or gap <= (max(ratios) - min(ratios)) / 2
