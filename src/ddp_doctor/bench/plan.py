"""What the `bench` parent tells a launch's ranks, and what their local rank 0 writes back: typed once for both sides.

A launch runs *blocks*: one candidate configuration for one round, that is `steps` optimizer steps observed by a
doctor (the correctness check) and then `steps` more timed with every hook removed. The parent passes a `BenchPlan`
(in its own environment variable, `ENV_VAR`, beside the check's `RankConfig`); the ranks write a `BenchLog` to `bench.json` in the node's output folder after every
change, so whatever the launch did before it ended (the script's loop ran out, a candidate crashed) is known.

Also here, because both sides apply them to the same numbers: `judge_report` (is a candidate's observed block
correct) and `round_end` (do the rounds stop).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.bench.candidates import Config
from ddp_doctor.bench.stats import MIN_ROUNDS, decide
from ddp_doctor.core.codes import Code
from ddp_doctor.core.rankfiles import write_json
from ddp_doctor.report.model import Report

__all__ = [
    "ENV_VAR",
    "LOG_FILE",
    "TIMING_FILE",
    "BenchLog",
    "BenchPlan",
    "Block",
    "judge_report",
    "round_end",
    "round_order",
    "unused_of",
]

ENV_VAR = "DDP_DOCTOR_BENCH"
"""The environment variable that carries the launch's `BenchPlan` to every rank."""
LOG_FILE = "bench.json"
TIMING_FILE = "timing.json"
"""The first timed block's step times, from the node's local rank 0: `{"rank": R, "step_s": [...]}`."""


def _config(d: dict[str, Any]) -> Config:
    return Config(**{**d, "freeze_before_wrap": tuple(d.get("freeze_before_wrap", ()))})


@dataclass(kw_only=True)
class BenchPlan:
    """The blocks one launch runs. Every rank reads the same plan, so every rank runs the same blocks in the same
    order and switches at the same optimizer step."""

    steps: int
    """K: optimizer steps observed, then K timed, per block."""
    rounds: int
    """The most rounds (blocks per candidate), counted over all launches."""
    auto: bool = False
    """The launch starts with the check (the script's own flags): the candidates are built in the ranks from the
    check's report (`candidates()`), filtered by `only`. Otherwise they are `candidates`."""
    only: list[str] | None = None
    candidates: list[tuple[str, Config]] = field(default_factory=list)
    """(name, configuration) of every candidate still in the running, in round order."""
    round: int = 0
    """The index of the round this launch starts in."""
    pending: list[str] = field(default_factory=list)
    """The candidates of that round that still have to run, in order; the first is the one DDP is built with."""
    history: dict[str, list[float]] = field(default_factory=dict)
    """Per candidate, the median step time of each complete round of earlier launches."""
    round_times: dict[str, float] = field(default_factory=dict)
    """The median step times of the candidates that already ran in the round this launch starts in."""
    baseline_unused: list[str] = field(default_factory=list)
    """The parameters the check found unused (a correct candidate has the same used set, freezing aside)."""
    budget_deadline: float | None = None
    """Wall-clock time (`time.time()`) after which no new round starts; None: no budget, or (with `budget_s`) it
    starts when the check is done."""
    budget_s: float | None = None
    share: bool = True
    """Rebuild DDP in place between blocks. False: run the first pending block only, then end."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidates"] = [[n, c.to_dict()] for n, c in self.candidates]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchPlan:
        return cls(**{**d, "candidates": [(n, _config(c)) for n, c in d.get("candidates", [])]})

    def to_env(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_env(cls) -> BenchPlan:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            raise RuntimeError(f"{ENV_VAR} is not set: ddp_doctor.bench.start is started by `ddp-doctor bench`.")
        return cls.from_dict(json.loads(raw))


@dataclass(kw_only=True)
class Block:
    """One candidate's block in one round."""

    round: int
    name: str
    status: str = "observing"
    """observing, timing, done (correct and timed), incorrect, or check (the check's own steps, not a candidate)."""
    reason: str = ""
    """Why it is incorrect."""
    step_s: list[float] = field(default_factory=list)
    """The timed optimizer steps (seconds), from this node's local rank 0."""


@dataclass(kw_only=True)
class BenchLog:
    """What one launch did, as written by the node's local rank 0."""

    candidates: list[tuple[str, Config]] = field(default_factory=list)
    """The candidates the ranks ran (in an `auto` launch: built from the check's report)."""
    blocks: list[Block] = field(default_factory=list)
    ddp_built_at: float | None = None
    """`time.time()` when the script built its DDP model."""
    first_step_at: float | None = None
    """`time.time()` of the script's first optimizer step: its start-up ends here."""
    shared: bool = True
    why_not_shared: str = ""
    """Why the candidates cannot run in this launch one after another (empty when they can)."""
    ended: str = ""
    """Why the ranks stopped running blocks: `stopped` below, the script's loop ended, the timeout was near."""
    stopped: str = ""
    """Set when the rounds are over (settled, the maximum, the budget): no launch follows."""
    steps_run: int = 0
    """Optimizer steps the script ran in this launch."""
    budget_deadline: float | None = None

    def write(self, folder: Path) -> None:
        d = asdict(self)
        d["candidates"] = [[n, c.to_dict()] for n, c in self.candidates]
        write_json(folder / LOG_FILE, d)

    @classmethod
    def read(cls, folder: Path) -> BenchLog | None:
        try:
            d = json.loads((folder / LOG_FILE).read_text())
        except (OSError, ValueError):
            return None
        return cls(
            **{
                **d,
                "candidates": [(n, _config(c)) for n, c in d["candidates"]],
                "blocks": [Block(**b) for b in d["blocks"]],
            }
        )

    @property
    def current(self) -> Block | None:
        """The block that was running when the launch ended (None when none was)."""
        last = self.blocks[-1] if self.blocks else None
        return last if last is not None and last.status in ("observing", "timing") else None


def unused_of(report: Report) -> set[str]:
    found = report.finding(Code.UNUSED_PARAMETERS)
    return set(found.param_names) if found else set()


def judge_report(
    report: Report, config: Config, baseline_unused: set[str], others: list[Report] | tuple[Report, ...] = ()
) -> tuple[bool, str]:
    """Whether a candidate's observed steps were correct, and why not: no error-level finding (in the report of any
    DDP model the script built: `others` are the second and later), and the same used set as the check's for the
    first model (parameters frozen before wrapping aside).

    The used-set rule does not apply to `find_unused_parameters=True`, which handles whatever set a step uses: in a
    shared launch a later block runs at a later step of the script, where its graph may differ from the check's
    first steps (an auxiliary loss switched off after warm-up). The other flags depend on that set staying the same.
    """
    errors = [f for r in (report, *others) for f in r.findings if f.severity == "error"]
    if errors:
        return False, f"{', '.join(f.code for f in errors)} ({errors[0].title})"
    frozen = set(config.freeze_before_wrap)
    unused = unused_of(report) - frozen
    if unused != baseline_unused - frozen and not config.find_unused_parameters:
        return False, (
            f"the used set differs from the check's: unused {sorted(unused_of(report))}, "
            f"expected {sorted(baseline_unused - frozen)}"
        )
    return True, ""


def round_order(live: list[str], index: int) -> list[str]:
    """The order of round `index`: the candidates still correct, rotated by one place each round, so that no
    candidate always runs right after a given other one (drift within a round hits every candidate alike)."""
    if not live:
        return []
    k = index % len(live)
    return live[k:] + live[:k]


def round_end(
    history: dict[str, list[float]],
    configs: dict[str, Config],
    *,
    rounds_done: int,
    rounds: int,
    budget_spent: bool,
    budget_s: float | None = None,
) -> str:
    """After a complete round: why the rounds stop now, or "" to go on. `history` holds the per-round median step
    times of the correct candidates (the same rounds for all)."""
    decision = decide(history, configs)
    if decision is not None and decision.settled and rounds_done >= MIN_ROUNDS:
        return "settled: more rounds would not change the verdict"
    if rounds_done >= rounds:
        return f"the maximum of {rounds}"
    if budget_spent:
        return f"the --budget of {budget_s or 0:g} s was spent"
    if not history:
        return "no candidate is left"
    return ""
