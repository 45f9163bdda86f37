"""`ddp-doctor bench` inside each rank: every candidate in the same processes, so the script starts once.

This is the in-rank run's policy under `ddp-doctor bench` (`launch/policy.py`'s `RunPolicy`, handed to the run by
`start.py`, the bench's entry point in every rank): the run (`launch/session.py`) hands over after the check's K
observed steps and its report (`reported`). From then on this driver runs *blocks* (see `plan.py`): for each candidate, it puts the model and the optimizer back where they were
just before the script's first optimizer step, rebuilds the script's own `DistributedDataParallel` object in place
with the candidate's arguments (`rebuild.py`; the script's loop keeps its reference, so it trains the rebuilt
wrapper without knowing), observes K steps with a fresh `Doctor` (the correctness check, a collective report as in
`check`), then times K more steps with every hook removed. Candidates are interleaved in rounds, each rotated by
one place: A B C, B C A, C A B, ...

Every rank switches at the same optimizer step: the schedule comes from the plan and from the reports, which are
identical on every rank. The only decision taken on timings (do the rounds stop) uses rank 0's numbers, shared by one
fixed-shape all_gather at the end of each round, so no rank decides alone.

The launch ends (`host.leave()`, the rest of the script never runs) when the rounds are over, when another round
might not fit in the launch's timeout, or when the candidates cannot share the launch (several DDP models, a DDP
that cannot be rebuilt, an optimizer state that cannot be copied): the parent then starts the rest in new launches.
When the script's own loop ends first, the run calls `script_ended`.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ddp_doctor.bench.candidates import Config, candidates
from ddp_doctor.bench.inplace import Snapshot, rebuild_in_place, why_not_shared
from ddp_doctor.bench.plan import (
    TIMING_FILE,
    BenchLog,
    BenchPlan,
    Block,
    judge_report,
    round_end,
    round_order,
    unused_of,
)
from ddp_doctor.core.errors import DoctorError
from ddp_doctor.core.rankfiles import write_json
from ddp_doctor.doctor import Doctor
from ddp_doctor.exchange.oddranks import pick
from ddp_doctor.exchange.primitives import comm_device
from ddp_doctor.launch.policy import StopsAtReport
from ddp_doctor.report.model import Report

__all__ = ["BenchHost", "InRankBench"]


class BenchHost(Protocol):
    """What the driver needs from the session that runs the script."""

    rank: int
    local_rank: int
    outdir: Path
    deadline: float
    """Wall-clock time by which the launch must have ended (0: none)."""
    original_init: Callable[..., None]
    """DDP's own `__init__` (the session's wrapper would observe the rebuilt model as a new one)."""

    def leave(self) -> None: ...

    def remaining(self) -> float: ...

    def on_phase(self, doctor: Doctor) -> None: ...


class InRankBench(StopsAtReport):
    """The per-rank bench driver. See the module docstring. Its run is not the whole job (`StopsAtReport`)."""

    def __init__(self, host: BenchHost, plan: BenchPlan) -> None:
        self.host, self.plan = host, plan
        self.log = BenchLog(budget_deadline=plan.budget_deadline)
        self.ddp: DistributedDataParallel | None = None
        self.optimizer: Optimizer | None = None
        self.took_over = False
        self._trainable: list[bool] = []
        self._snapshot: Snapshot | None = None
        self._snapshot_error = ""
        self._base_kwargs: dict[str, Any] = {}
        self._configs: dict[str, Config] = {}
        self._live: list[str] = []
        self._pending: list[str] = list(plan.pending)
        self._round = plan.round
        self._history = {n: list(v) for n, v in plan.history.items()}
        self._round_times: dict[str, float] = dict(plan.round_times)
        self._baseline_unused = set(plan.baseline_unused)
        self._block: Block | None = None
        self._stamps: list[float] | None = None
        self._arm = False
        self._timed_blocks = 0
        self._steps = 0
        self._round_started = 0.0
        self._longest_round = 0.0
        self._done = False
        # Registered before any doctor's hooks, never removed while a step runs: torch iterates these dicts.
        self._hooks = [register_optimizer_step_pre_hook(self._on_pre), register_optimizer_step_post_hook(self._on_post)]

    # ------------------------------------------------------------------------------------------- the script

    def wrapped(self, ddp: DistributedDataParallel, trainable: list[bool]) -> None:
        """The script built a DDP model; `trainable` is its own `requires_grad` before any freezing."""
        if self.ddp is not None:
            return
        self.ddp, self._trainable = ddp, trainable
        self.log.ddp_built_at = time.time()
        self._write()

    def _owns(self, opt: Optimizer) -> bool:
        assert self.ddp is not None
        mine = {id(p) for p in self.ddp.module.parameters()}
        return any(id(p) in mine for g in opt.param_groups for p in g["params"])

    def _on_pre(self, opt: Optimizer, _args: Any, _kwargs: Any) -> None:
        if self.optimizer is not None or self.ddp is None or self._done or not self._owns(opt):
            return
        # The starting point every candidate's block goes back to: the replicas are identical here (DDP broadcast
        # them at construction and no step has changed them), and the optimizer has no state yet.
        self.optimizer = opt
        self.log.first_step_at = time.time()
        try:
            self._snapshot = Snapshot.take(self.ddp.module, opt)
        except Exception as exc:  # noqa: BLE001  (then the candidates do not share the launch; the bench goes on)
            self._snapshot_error = f"the model and optimizer state could not be copied ({exc})"
        self._write()

    def _on_post(self, opt: Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._done or (self.optimizer is not None and opt is not self.optimizer):
            return
        self._steps += 1
        if self._arm:
            # The block's doctor finished on this very step (its hook runs before this one): timing starts now.
            self._arm = False
            self._stamps = [time.perf_counter()]
            return
        if self._stamps is None:
            return
        self._stamps.append(time.perf_counter())
        if len(self._stamps) > self.plan.steps:
            self._timed()

    # ------------------------------------------------------------------------------------------- the policy

    def reported(self, doctors: list[Doctor], reports: list[Report]) -> bool:
        """`RunPolicy.reported`: take over (always)."""
        self.take_over(doctors, reports)
        return True

    def script_ended(self) -> bool:
        """`RunPolicy.script_ended`: keep what was timed, when the driver had taken over."""
        if not self.took_over:
            return False
        self.on_script_end()
        return True

    # ------------------------------------------------------------------------------------------- hand-over

    def take_over(self, doctors: list[Doctor], reports: list[Report]) -> None:
        """The check's K steps are observed and reported (`reports`, one per DDP model, identical on every rank):
        run the blocks."""
        report = reports[0]
        self.took_over = True
        self.log.steps_run = self._steps
        if self.optimizer is None:
            self.optimizer = next((d.optimizer for d in doctors if d.optimizer is not None), None)
        plan = self.plan
        if plan.auto:
            cands = [(n, c) for n, c in candidates(report) if plan.only is None or n in plan.only]
            self._baseline_unused = unused_of(report)
            self._pending = [n for n, _ in cands]
            first = "user"
        else:
            cands = list(plan.candidates)
            first = self._pending[0] if self._pending else ""
        self.log.candidates = cands
        self._configs = dict(cands)
        self._live = [n for n, _ in cands]
        if plan.budget_deadline is None and plan.budget_s is not None:
            self.log.budget_deadline = time.time() + plan.budget_s
        if not self.plan.share:
            self.log.why_not_shared = "the parent asked for one block"
        else:
            self.log.why_not_shared, self._base_kwargs = why_not_shared(
                doctors, self.ddp, self.optimizer, self._snapshot, self._snapshot_error
            )
        self.log.shared = not self.log.why_not_shared
        self._round_started = time.monotonic()
        if first in self._pending:
            # The steps just observed are the first block: the script's own flags (the check) or the candidate
            # this launch built DDP with.
            self._pending.remove(first)
            self._block = Block(round=self._round, name=first)
            self.log.blocks.append(self._block)
            correct, reason = judge_report(report, self._configs[first], self._baseline_unused, reports[1:])
            if correct:
                self._start_timing(arm=False)
                return
            self._incorrect(reason)
        elif not cands and not plan.auto:
            # `launched.time_steps` (a plan with no candidates): only the steps after the report are timed.
            self._block = Block(round=0, name="check")
            self.log.blocks.append(self._block)
            self._start_timing(arm=False)
            return
        else:
            self.log.blocks.append(Block(round=self._round, name="check", status="check"))
        self._next()

    def on_script_end(self) -> None:
        """The script's loop ended (the session is about to leave): keep what the current block timed."""
        if self._block is not None and self._stamps is not None:
            self._block.step_s = _durations(self._stamps)
            if self._timed_blocks == 0:
                self._write_timing(self._block.step_s)
        self.log.ended = f"the script's loop ended after {self._steps} optimizer steps"
        self._end()

    # ------------------------------------------------------------------------------------------------ blocks

    def _next(self) -> None:
        """Start the next block, or end the launch."""
        while True:
            if not self.log.shared:
                self.log.ended = f"not shared: {self.log.why_not_shared}"
                break
            if not self._pending:
                stop = self._round_end()
                if stop:
                    break
                self._round += 1
                self._pending = round_order(self._live, self._round)
                self._round_started = time.monotonic()
            name = self._pending.pop(0)
            self._block = Block(round=self._round, name=name)
            self.log.blocks.append(self._block)
            if self._begin(name):
                return
        self._end()
        self.host.leave()

    def _begin(self, name: str) -> bool:
        """Restore the starting point, rebuild DDP for `name` and observe K steps. False if it could not start."""
        assert self.ddp is not None and self.optimizer is not None and self._snapshot is not None
        config = self._configs[name]
        try:
            self._snapshot.restore(self.ddp.module, self.optimizer)
            rebuild_in_place(self.ddp, self._base_kwargs, config, self._trainable, self.host.original_init)
            doctor = Doctor(self.ddp, optimizer=self.optimizer, steps=self.plan.steps)
        except Exception as exc:  # noqa: BLE001  (DDP refused the arguments: the candidate is incorrect)
            self._incorrect(f"DDP could not be built with it: {type(exc).__name__}: {exc}"[:500])
            return False
        doctor.on_steps_done = self._observed
        doctor.on_phase = self.host.on_phase
        doctor.start()
        self._write()
        return True

    def _observed(self, doctor: Doctor) -> None:
        """The block's K steps are observed (inside the optimizer step's hooks): judge them."""
        block = self._block
        assert block is not None
        try:
            report = doctor.report(timeout=self.host.remaining())
        except DoctorError as exc:
            self._incorrect(f"the ranks could not exchange records: {exc}"[:500])
            self.log.ended = "the ranks could not exchange records"
            self._end()
            self.host.leave()
            return
        correct, reason = judge_report(report, self._configs[block.name], self._baseline_unused)
        if correct:
            self._start_timing(arm=True)
        else:
            self._incorrect(reason)
            self._next()

    def _start_timing(self, *, arm: bool) -> None:
        assert self._block is not None
        self._block.status = "timing"
        if arm:
            self._arm = True
        else:
            self._stamps = [time.perf_counter()]
        self._write()

    def _timed(self) -> None:
        block = self._block
        assert block is not None
        block.step_s, block.status = _durations(self._stamps), "done"
        self._stamps = None
        self._round_times[block.name] = statistics.median(block.step_s)
        if self._timed_blocks == 0:
            self._write_timing(block.step_s)
        self._timed_blocks += 1
        if block.name == "check":  # `launched.time_steps`
            self.log.ended = "the timed steps are done"
            self._end()
            self.host.leave()
            return
        self._write()
        self._next()

    def _incorrect(self, reason: str) -> None:
        assert self._block is not None
        self._block.status, self._block.reason = "incorrect", reason
        if self._block.name in self._live:
            self._live.remove(self._block.name)
        self._history.pop(self._block.name, None)
        self._write()

    def _round_end(self) -> str:
        """A round is complete on every rank: agree on rank 0's timings and clock, and decide whether to go on.

        Returns why the launch stops ("" to go on)."""
        assert self.ddp is not None
        names = list(self._configs)
        now = time.time()
        self._longest_round = max(self._longest_round, time.monotonic() - self._round_started)
        budget = self.log.budget_deadline
        near = bool(self.host.deadline) and now + 2 * self._longest_round + 5.0 > self.host.deadline
        row = torch.tensor(
            [float(budget is not None and now > budget), float(near), *(self._round_times.get(n, -1.0) for n in names)],
            dtype=torch.float64,
        )
        group = self.ddp.process_group
        param = next(self.ddp.module.parameters(), None)
        # Group rank 0's row on every rank (its values are finite: flags and times, -1 for none).
        agreed = pick(
            row.unsqueeze(0),
            torch.zeros(1, dtype=torch.int64),
            group=group,
            device=comm_device(group, param.device if param is not None else None),
        )[0]
        for i, name in enumerate(names):
            if name in self._live and agreed[2 + i] > 0:
                self._history.setdefault(name, []).append(float(agreed[2 + i]))
        self._round_times.clear()
        live = {n: self._history[n] for n in self._live if n in self._history}
        stop = round_end(
            live,
            {n: self._configs[n] for n in live},
            rounds_done=self._round + 1,
            rounds=self.plan.rounds,
            budget_spent=bool(agreed[0]),
            budget_s=self.plan.budget_s,
        )
        if stop:
            self.log.ended = self.log.stopped = stop
        elif agreed[1]:
            self.log.ended = "another round might not end before the launch's --timeout"
            return self.log.ended
        return stop

    # ------------------------------------------------------------------------------------------------ output

    def _end(self) -> None:
        # The hooks stay registered (removing one while torch iterates them would break the step); they go idle.
        self._done = True
        self._stamps = None
        self.log.steps_run = self._steps
        self._write()

    def _write(self) -> None:
        if self.host.local_rank == 0:
            self.log.write(self.host.outdir)

    def _write_timing(self, steps: list[float]) -> None:
        if self.host.local_rank == 0:
            write_json(self.host.outdir / TIMING_FILE, {"rank": self.host.rank, "step_s": steps})


def _durations(stamps: list[float] | None) -> list[float]:
    """The step times between consecutive stamps."""
    return [b - a for a, b in itertools.pairwise(stamps or [])]
