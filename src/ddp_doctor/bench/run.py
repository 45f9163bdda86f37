"""Run the candidates interleaved in rounds, judge each run's correctness, and pick the fastest correct one.

Each run is a `check` with the candidate's DDP arguments: the doctor observes the first K steps (that is the
correctness check: no error finding, gradients identical across ranks at every optimizer step, the same used set
as the baseline check), then removes every hook and times K more optimizer steps. Only those unobserved steps are
timed.

The verdict (`stats.py`): each candidate is compared with the correct candidate that does the least work, through
paired per-round ratios and a bootstrap interval of their median; a candidate wins only when it is clearly faster,
else the least-work one is kept. `--rounds` is a maximum: rounds stop once more of them could not change the
verdict, or when `--budget` seconds have passed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.bench.candidates import Config, candidates
from ddp_doctor.bench.stats import MIN_ROUNDS, Comparison, Verdict, decide
from ddp_doctor.launch.outcome import CheckResult
from ddp_doctor.launch.supervise import check_namespace
from ddp_doctor.report.model import Recommendation, Report
from ddp_doctor.report.snippets import render_snippets

__all__ = ["BenchResult", "Candidate", "run_bench"]

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
    decision: Verdict | None = None
    rounds_run: int = 0
    stopped: str = ""
    """Why the rounds stopped: the verdict was settled, the maximum was reached, or the budget ran out."""

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
        head = ("Measured fastest correct configuration" if self.decision.measured else
                "Correct configuration that does the least work")
        rec = Recommendation(
            find_unused_parameters=c.find_unused_parameters, static_graph=c.static_graph,
            gradient_as_bucket_view=c.gradient_as_bucket_view, freeze_before_wrap=list(c.freeze_before_wrap),
            verified=True,
            reason=f"{head} ({self.winner.name}). {self.decision.reason} Rounds: {self.rounds_run} ({self.stopped}).")
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
                "vs_reference": None if (cmp := self.comparison(c)) is None else {
                    "median_ratio": cmp.ratio, "low": cmp.low, "high": cmp.high, "rounds": cmp.rounds},
                "rounds": c.rounds,
            } for c in self.candidates],
            "winner": None if best is None else {
                "name": best.name, "config": best.config.to_dict(),
                "reference": self.decision.reference if self.decision else None,
                "measured": self.decision.measured if self.decision else False,
                "reason": self.decision.reason if self.decision else ""},
            "rounds_run": self.rounds_run, "stopped": self.stopped,
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
              only: list[str] | None = None, budget: float | None = None,
              on_progress: Callable[[str], None] | None = None) -> BenchResult:
    """Check the script once, then run every candidate in interleaved rounds until the verdict is settled.

    Args:
        namespace: torchrun's parsed namespace for the script (as a dict).
        steps: K: optimizer steps observed for correctness, then K more timed, per run.
        rounds: the most rounds (runs per candidate); fewer when the verdict settles earlier.
        timeout: per run, in seconds.
        log_dir: the script's output of every run goes to a file here.
        only: candidate names to keep (default: all).
        budget: seconds after which no new round starts (None: no limit).
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
    started = time.monotonic()
    decision: Verdict | None = None
    done, stopped = 0, f"the maximum of {rounds}"
    for _ in range(rounds):
        for cand in cands:
            if not cand.correct:
                continue    # a candidate is incorrect once: it is never timed as a winner
            result = run(cand.name, cand.config, steps)
            cand.correct, cand.reason = judge(result, cand.config, baseline, steps)
            if cand.correct:
                cand.rounds.append(list(result.step_times or []))
        done += 1
        decision = _decide(cands)
        if decision is not None and decision.settled and done >= MIN_ROUNDS:
            stopped = "settled: more rounds would not change the verdict"
            break
        if budget is not None and time.monotonic() - started > budget and done < rounds:
            stopped = f"the --budget of {budget:g} s was spent"
            break
    correct = {c.name: c for c in cands if c.correct and c.rounds}
    decision = _decide(cands)
    winner = correct[decision.choice] if decision is not None else None
    return BenchResult(check=baseline, candidates=cands, winner=winner, decision=decision, rounds_run=done,
                       stopped=stopped)


def _decide(cands: list[Candidate]) -> Verdict | None:
    correct = [c for c in cands if c.correct and c.rounds]
    return decide({c.name: c.round_medians() for c in correct}, {c.name: c.config for c in correct})
