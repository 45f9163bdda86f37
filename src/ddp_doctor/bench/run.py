"""Run the candidates interleaved in rounds, judge each one's correctness, and pick the fastest correct one.

The script starts once where it can. The first launch runs the check (the script's own flags, K steps observed);
then, in the same processes, the ranks build the candidates from the check's report and run them block after block
(`inrank.py`): DDP rebuilt in place with the candidate's arguments, the model and optimizer put back to their state
before the first step, K steps observed by a doctor (the correctness check: no error finding, gradients identical
across ranks at every optimizer step, the same used set as the check), then K steps timed with every hook removed.
Candidates are interleaved in rounds, each rotated by one place (A B C, B C A, C A B, ...).

A new launch starts only when the previous one cannot go on, and the result says why: the check (or a candidate)
crashed, which leaves the processes unusable; the script's own loop ended before the blocks did; another round
might not fit in `--timeout`; or the candidates cannot share a launch at all (several DDP models, a DDP that
cannot be rebuilt, an optimizer state that cannot be copied), and then each block gets its own launch. A later
launch builds DDP with its first candidate directly and goes on from there.

The verdict (`stats.py`): each candidate is compared with the correct candidate that does the least work, through
paired per-round ratios and a bootstrap interval of their median; a candidate wins only when it is clearly faster,
else the least-work one is kept. `--rounds` is a maximum: rounds stop once more of them could not change the
verdict, or when `--budget` seconds have passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_doctor.bench.candidates import Config, candidates
from ddp_doctor.bench.launched import LaunchResult, run_launch
from ddp_doctor.bench.plan import BenchLog, BenchPlan, Block, round_end, round_order, unused_of
from ddp_doctor.bench.result import SCHEMA, BenchResult, Candidate, Launch, judge
from ddp_doctor.bench.stats import Verdict, decide
from ddp_doctor.launch.config import RankConfig
from ddp_doctor.report.model import Report

__all__ = ["SCHEMA", "BenchResult", "Candidate", "Launch", "judge", "run_bench"]


def run_bench(
    namespace: dict[str, Any],
    *,
    steps: int,
    rounds: int,
    timeout: float,
    log_dir: Path,
    only: list[str] | None = None,
    budget: float | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Check the script, then run every candidate in interleaved rounds until the verdict is settled.

    Args:
        namespace: torchrun's parsed namespace for the script (as a dict).
        steps: K: optimizer steps observed for correctness, then K more timed, per block.
        rounds: the most rounds (blocks per candidate); fewer when the verdict settles earlier.
        timeout: per launch, in seconds.
        log_dir: the script's output of every launch goes to a file here, and the ranks' files to a folder.
        only: candidate names to keep (default: all).
        budget: seconds after the check after which no new round starts (None: no limit).
        on_progress: called before each launch with a description.

    Raises:
        RuntimeError: the check produced no report (the script could not start, or built no DDP model).
    """
    return _Runner(
        namespace,
        steps=steps,
        rounds=rounds,
        timeout=timeout,
        log_dir=log_dir,
        only=only,
        budget=budget,
        on_progress=on_progress,
    ).run()


class _Runner:
    """The parent's side of the bench: launches, and the schedule reconstructed from what each one did."""

    def __init__(
        self,
        namespace: dict[str, Any],
        *,
        steps: int,
        rounds: int,
        timeout: float,
        log_dir: Path,
        only: list[str] | None,
        budget: float | None,
        on_progress: Callable[[str], None] | None,
    ) -> None:
        self.namespace, self.steps, self.rounds, self.timeout = namespace, steps, rounds, timeout
        self.log_dir, self.only, self.budget, self.on_progress = log_dir, only, budget, on_progress
        self.cands: dict[str, Candidate] = {}
        self.round = 0
        self.pending: list[str] = []
        self.launches: list[Launch] = []
        self.stopped = ""
        self.budget_deadline: float | None = None
        self.why_not_shared = ""
        self.baseline: Report | None = None
        self.crashed = ""
        """The candidate whose block was running when its launch crashed."""

    # ------------------------------------------------------------------------------------------------ flow

    def run(self) -> BenchResult:
        result, log = self._launch(
            BenchPlan(steps=self.steps, rounds=self.rounds, auto=True, only=self.only, budget_s=self.budget),
            None,
            "the check; the candidates follow in the same processes",
        )
        if result.check.report is None:
            raise RuntimeError(result.check.error or "the check produced no report")
        self.baseline = result.check.report
        built = log.candidates if log is not None and log.candidates else candidates(self.baseline)
        self.cands = {n: Candidate(name=n, config=c) for n, c in built if self.only is None or n in self.only}
        self.pending = list(self.cands)
        self.budget_deadline = (
            log.budget_deadline
            if log is not None and log.budget_deadline
            else time.time() + self.budget
            if self.budget is not None
            else None
        )
        why = self._absorb(result, log, first="user" if log is None or not log.blocks else None)
        while not self.stopped and why:
            if len(self.launches) > 2 * len(self.cands) * self.rounds + 2:
                self.stopped = "too many launches"  # a guard: every launch below makes progress
                break
            first = self.pending[0]
            plan = self._plan()
            result, log = self._launch(plan, self.cands[first].config, why)
            why = self._absorb(result, log, first=first)
        decision = _decide(list(self.cands.values()))
        correct = {c.name: c for c in self.cands.values() if c.correct and c.rounds}
        winner = correct[decision.choice] if decision is not None else None
        return BenchResult(
            check=self.baseline,
            candidates=list(self.cands.values()),
            winner=winner,
            decision=decision,
            rounds_run=self.round + (0 if self.pending else 1),
            stopped=self.stopped,
            launches=self.launches,
        )

    def _plan(self) -> BenchPlan:
        live = [n for n, c in self.cands.items() if c.correct]
        medians = {n: self.cands[n].round_medians() for n in live}
        return BenchPlan(
            steps=self.steps,
            rounds=self.rounds,
            candidates=[(n, self.cands[n].config) for n in live],
            round=self.round,
            pending=list(self.pending),
            history={n: m[: self.round] for n, m in medians.items()},
            round_times={n: m[self.round] for n, m in medians.items() if len(m) > self.round},
            baseline_unused=sorted(unused_of(self.baseline)) if self.baseline is not None else [],
            budget_deadline=self.budget_deadline,
            budget_s=self.budget,
            share=not self.why_not_shared,
        )

    def _launch(self, plan: BenchPlan, config: Config | None, why: str) -> tuple[LaunchResult, BenchLog | None]:
        index = len(self.launches) + 1
        first = plan.pending[0] if plan.pending else "check"
        if self.on_progress is not None:
            self.on_progress(f"launch {index}: {first}" + (" and the rest" if plan.share else ""))
        folder = self.log_dir / f"launch{index}"
        config_ = RankConfig(
            target=self.namespace["training_script"],
            module=bool(self.namespace["module"]),
            steps=self.steps,
            ddp_kwargs=config.ddp_kwargs if config is not None else {},
            freeze_before_wrap=list(config.freeze_before_wrap) if config is not None else [],
        )
        started = time.time()
        with open(self.log_dir / f"launch{index}.log", "a") as output:
            result = run_launch(self.namespace, config_, plan, timeout=self.timeout, output=output, outdir=folder)
        log = result.log
        self.launches.append(
            Launch(
                index=index,
                why=why,
                wall_s=time.time() - started,
                startup_s=log.first_step_at - started if log is not None and log.first_step_at else None,
            )
        )
        return result, log

    # --------------------------------------------------------------------------------------------- merging

    def _absorb(self, result: LaunchResult, log: BenchLog | None, *, first: str | None) -> str:
        """Fold one launch's blocks into the candidates and the schedule. Returns why another launch is needed
        ("" when the rounds are over). `first`: the candidate the launch built DDP with, when its block must be
        judged from the launch's result (the session's doctor observed it and the ranks never got further)."""
        launch = self.launches[-1]
        blocks = [b for b in (log.blocks if log is not None else []) if b.status != "check"]
        if log is not None and not log.shared and not self.why_not_shared:
            self.why_not_shared = log.why_not_shared  # later launches, run one block each, keep the first reason
        if first is not None and not blocks and first in self.cands:
            correct, reason = judge(result, self.cands[first].config, self.baseline, self.steps)
            cand = self.cands[first]
            if correct and result.step_times:
                cand.rounds.append(list(result.step_times))
            else:
                cand.correct, cand.reason = False, reason
            self._done(first, self.round)
            launch.blocks.append(f"{first} (round {self.round + 1})")
        for block in blocks:
            if block.round > self.round:
                self._next_round(block.round)
            if self._apply(block, result, log, first_in_launch=block is blocks[0]):
                launch.blocks.append(f"{block.name} (round {block.round + 1})")
        launch.ended = self._ended(result, log)
        if log is not None and log.stopped:
            self.stopped = log.stopped
            return ""
        if not self.pending:
            stop = self._round_end()
            if stop:
                self.stopped = stop
                return ""
            self._next_round(self.round + 1)
        return self._why_next(result, log, launch)

    def _apply(self, block: Block, result: LaunchResult, log: BenchLog | None, *, first_in_launch: bool) -> bool:
        """One block of the launch's log; True when it settled something (the candidate was timed or failed)."""
        cand = self.cands.get(block.name)
        if cand is None:
            return False
        if block.status == "done":
            cand.rounds.append(block.step_s)
        elif block.status == "incorrect":
            cand.correct, cand.reason = False, block.reason
        elif result.late_crash or (result.check.error and not result.check.timed_out):
            self.crashed = block.name
            cand.correct = False
            cand.reason = f"crashed during its block: {result.late_crash or result.check.error}"[:500]
        elif result.check.timed_out and first_in_launch:
            cand.correct = False
            cand.reason = f"its block did not end within the launch's --timeout ({self.timeout:g} s)"
        elif log is not None and log.ended.startswith("the script's loop ended") and first_in_launch:
            if block.step_s:  # the script is shorter than one block: what was timed is all there is
                cand.rounds.append(block.step_s)
            else:
                cand.correct = False
                cand.reason = f"no step was timed (the script ended before {self.steps} more steps)"
        else:
            return False  # not its fault: it runs again in the next launch
        self._done(block.name, block.round)
        return True

    def _done(self, name: str, round_: int) -> None:
        if round_ == self.round and name in self.pending:
            self.pending.remove(name)

    def _next_round(self, index: int) -> None:
        self.round = index
        self.pending = round_order([n for n, c in self.cands.items() if c.correct], index)

    def _round_end(self) -> str:
        live = {n: c.round_medians() for n, c in self.cands.items() if c.correct and c.rounds}
        spent = self.budget_deadline is not None and time.time() > self.budget_deadline
        return round_end(
            live,
            {n: self.cands[n].config for n in live},
            rounds_done=self.round + 1,
            rounds=self.rounds,
            budget_spent=spent,
            budget_s=self.budget,
        )

    @staticmethod
    def _ended(result: LaunchResult, log: BenchLog | None) -> str:
        if result.check.timed_out:
            return "stopped at --timeout"
        if result.late_crash:
            return f"a rank crashed: {result.late_crash}"[:300]
        if log is not None and log.ended:
            return log.ended
        if result.check.error:
            return result.check.error.splitlines()[0][:300]
        errors = list(
            dict.fromkeys(f.code for m in result.check.models for f in m.report.findings if f.severity == "error")
        )
        return f"the observed steps failed: {', '.join(errors)}" if errors else "the script ended"

    def _why_next(self, result: LaunchResult, log: BenchLog | None, launch: Launch) -> str:
        """Why the next launch is needed, in words for the output."""
        if self.why_not_shared:
            return f"the candidates cannot share a launch: {self.why_not_shared}"
        if log is None or not log.blocks:
            what = "the check" if launch.index == 1 else "its first block"
            return (
                f"{what} ended launch {launch.index} ({launch.ended}); a crashed or finished process cannot "
                "go on, so the candidates start a new one"
            )
        if result.late_crash:
            return (
                f"{self.crashed or 'a candidate'} crashed in launch {launch.index}, which ends that launch; a "
                "crashed process cannot go on"
            )
        if result.check.timed_out:
            return f"launch {launch.index} reached --timeout ({self.timeout:g} s)"
        if log.ended.startswith("the script's loop ended"):
            return f"{log.ended} in launch {launch.index}, before the remaining blocks"
        return f"launch {launch.index} ended: {log.ended or 'early'}"


def _decide(cands: list[Candidate]) -> Verdict | None:
    correct = [c for c in cands if c.correct and c.rounds]
    return decide({c.name: c.round_medians() for c in correct}, {c.name: c.config for c in correct})
