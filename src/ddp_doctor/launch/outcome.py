"""Turn what the ranks left in the node's output folder into the check's result.

When the ranks exchanged their records, `report.json` holds the full reports. When they could not (a rank crashed
alone, or hung), each rank's own files still say how it ended; the result then names the rank that failed, its
step, its error or where it was stuck, and what the other ranks were waiting in.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.core.codes import SEVERITIES
from ddp_doctor.core.findings import Finding, finite
from ddp_doctor.core.rankfiles import Outcome, read_ends
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.rankstate import RankState, read_rank_states
from ddp_doctor.core.sharded_run import parallelism_of
from ddp_doctor.report.model import Report, RunFacts
from ddp_doctor.report.text import finding_sentences

__all__ = ["CheckResult", "Model", "collect", "exit_code"]


@dataclass(kw_only=True)
class Model:
    """One observed DDP model and its report."""

    report: Report
    site: str | None = None
    framework: str = "torch"
    module: str = ""


@dataclass(kw_only=True)
class CheckResult:
    """Everything a `check` run produced on this node."""

    models: list[Model] = field(default_factory=list)
    error: str | None = None
    """Set when the tool could not run the script at all (exit code 2)."""
    timed_out: bool = False
    interrupted: int | None = None
    """The signal (2 SIGINT, 15 SIGTERM, 1 SIGHUP) that stopped `ddp-doctor` before the run ended."""
    clean_line: bool = True
    """Whether the script's output ended with a newline (else the report starts with one)."""
    torchrun_log: str | None = None
    """Where torchrun's own log lines were kept, when it wrote any."""
    launch: str | None = None
    """How this node's ranks were started: `warm` (forked from a preloaded interpreter), `fresh` (one interpreter
    each), `mixed`; None when no rank was started."""
    torchrun_rc: int | None = None
    """The exit status of this node's torchrun (None: it never started). Not 0 also when no worker failed but the
    agent did (another node's agent gone with the rendezvous store)."""

    @property
    def report(self) -> Report | None:
        return self.models[0].report if self.models else None

    def to_json(self) -> str:
        return json.dumps(finite(self.to_dict()), indent=2)

    def to_dict(self) -> dict[str, Any]:
        """The first model's report (schema `ddp-doctor/report@2`); further models go under `other_models`."""
        extra: dict[str, Any] = {}
        if self.interrupted is not None:
            extra["interrupted"] = True
        if self.torchrun_log is not None:
            extra["torchrun_log"] = self.torchrun_log
        if self.launch is not None:
            extra["launch"] = self.launch
        if not self.models:
            return {"schema": "ddp-doctor/report@2", "error": self.error, "findings": [], **extra}
        first, *rest = self.models
        out = {**first.report.to_dict(), "model": first.module}
        if rest:
            out["other_models"] = [{**m.report.to_dict(), "model": m.module} for m in rest]
        return {**out, **extra}


def exit_code(result: CheckResult, fail_on: str) -> int:
    """0: nothing at or above `fail_on`; 1: findings at or above it; 2: the tool could not run; 128 + the signal
    when `ddp-doctor` itself was interrupted (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""
    if result.interrupted is not None:
        return 128 + result.interrupted
    if result.error is not None or not result.models:
        return 2
    if fail_on == "never":
        return 0
    limit = SEVERITIES.index(fail_on)
    worst = [m.report.worst_severity() for m in result.models]
    return int(any(w is not None and SEVERITIES.index(w) <= limit for w in worst))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(
    outdir: Path,
    *,
    timed_out: bool,
    torchrun_rc: int | None,
    interrupted: int | None = None,
    native: list[str] | None = None,
    watched: bool = False,
) -> CheckResult:
    """Read the output folder after every rank has ended (`watched`: a `watch` run's, whose ranks trained on after
    the observed steps' report, `report.steps.json`)."""
    internal = [e for e in read_ends(outdir).values() if e.outcome is Outcome.INTERNAL_ERROR]
    if internal:
        end = internal[0]
        return CheckResult(
            error=f"ddp-doctor failed on rank {end.rank} with an internal error: "
            f"{end.error}. This is a bug in ddp-doctor, not a finding about your script; "
            "no report can be trusted from this run. Please report it with this traceback:\n"
            f"{end.traceback or ''}",
            timed_out=timed_out,
            interrupted=interrupted,
        )
    full = _read(outdir / "report.json")
    if full is not None:
        # Models over subgroups come from their groups' first ranks, in group order.
        extra = [
            m
            for p in sorted(outdir.glob("report.rank*.json"), key=lambda p: int(p.name[11:-5]))
            if (d := _read(p)) is not None
            for m in d["models"]
        ]
        models = [_model(m) for m in [*full["models"], *extra]]
        if not models:  # never a silent run: say why there is no report
            return CheckResult(
                error=f"no model was reported ({full.get('reason') or 'no reason recorded'}); this is a bug in "
                "ddp-doctor if the script trains a model, please report it.",
                timed_out=timed_out,
                interrupted=interrupted,
            )
        return CheckResult(models=models, timed_out=timed_out, interrupted=interrupted)

    # No joint report: the analysis of the ranks' own files (torch comes with it; a run with a report never
    # imports it in this process).
    from ddp_doctor.analyze import (
        diagnose_failure,
        explain_fsdp2_crash,
        explain_meta_params,
        init_waited_for,
        refused_at_wrap,
    )

    states = read_rank_states(outdir, end_time=time.time())
    steps = _read(outdir / "report.steps.json")
    if steps is not None and steps["models"] and states:
        # The observed steps were diagnosed; the run failed while `check` followed it to its epoch end.
        return CheckResult(
            models=_after_steps(
                steps["models"],
                states,
                timed_out,
                native or [],
                watched=watched,
                hung=_hung(outdir) if timed_out else [],
            ),
            timed_out=timed_out,
            interrupted=interrupted,
        )
    if not states:
        if interrupted is not None:
            return CheckResult(error="interrupted before any rank started", interrupted=interrupted)
        return CheckResult(
            error=f"the script did not start on any rank (torchrun exit code {torchrun_rc}); "
            "its output above says why.",
            timed_out=timed_out,
        )
    built = [s for s in states.values() if s.trained]
    if not built and interrupted is None and refused_at_wrap(states):
        # DDP's constructor refused the model (shapes differ by rank): a finding, not a failure to run.
        return CheckResult(
            models=[Model(report=_failure_report(states, timed_out, interrupted, native or []))], timed_out=timed_out
        )
    if not built:
        if interrupted is not None:
            return CheckResult(error="interrupted before the script built a DDP model", interrupted=interrupted)
        # A rank that only lost its peer is not the cause when another rank raised or died of a signal.
        died_of_signal = any(s.signal not in (None, "SIGTERM") for s in states.values())
        crashed = sorted(
            (s for s in states.values() if s.raised is not None and not (s.raised.peer_lost and died_of_signal)),
            key=lambda s: (s.raised.peer_lost, s.rank),
        )
        if crashed:
            crash = crashed[0].raised
            never_joined = init_waited_for(crashed[0], states)
            if never_joined is not None:
                return CheckResult(error=never_joined, timed_out=timed_out)
            meta_params = explain_meta_params(crash.message)
            if meta_params is not None:
                return CheckResult(
                    error=f"the script failed on rank {crashed[0].rank}: {meta_params}\n{crash.traceback}",
                    timed_out=timed_out,
                )
            shard = next((s.fully_shard for s in crashed if s.fully_shard), None)
            if shard is not None:  # no DDP to build: the sharded model's first optimizer step was not reached
                return CheckResult(
                    error=f"the script failed on rank {crashed[0].rank} before its first optimizer step, in "
                    f"{explain_fsdp2_crash(crash.type, crash.message, shard)}\n{crash.traceback}",
                    timed_out=timed_out,
                )
            return CheckResult(
                error=f"the script failed on rank {crashed[0].rank} before it built a DDP model: "
                f"{crash.type}: {crash.message}\n{crash.traceback}",
                timed_out=timed_out,
            )
        # The rank that died of its own signal; the launcher's SIGTERM to the others is not a cause.
        died = sorted(
            (s for s in states.values() if s.signal not in (None, "SIGTERM")), key=lambda s: (s.fault is None, s.rank)
        )
        if died:
            s = died[0]
            diagnosis = diagnose_failure(states, timed_out=timed_out, native=native or [])
            findings = [f for f in diagnosis.findings if s.rank in f.ranks]
            return CheckResult(
                error="before the script built a DDP model, "
                + (finding_sentences(findings[0]) if findings else f"rank {s.rank} died of {s.signal}."),
                timed_out=timed_out,
            )
        if timed_out:
            return CheckResult(
                error="the script built no DistributedDataParallel model before the timeout "
                f"(ranks {sorted(states)} were still running). Raise --timeout if its start-up "
                "is slow.",
                timed_out=True,
            )
        exited = [s for _, s in sorted(states.items()) if s.exit_status]
        if exited:  # sys.exit(2) from argparse, a script's own check of its arguments or environment
            first = exited[0]
            alike = [s.rank for s in exited if s.exit_status == first.exit_status]
            line, _, code = (first.exit_site or "").partition("  ")
            where = (f" at {line}" if line else "") + (f" (`{code.strip()}`)" if code.strip() else "")
            return CheckResult(
                error=f"the script exited with status {first.exit_status}{where} on {rank_list(alike)} before it "
                "built a DDP model, so there was nothing to observe; its own output above says why (an argument "
                "it did not accept, a file or a setting it did not find).",
                timed_out=timed_out,
            )
        return CheckResult(
            error="the script ran to the end without building a "
            "torch.nn.parallel.DistributedDataParallel model, so there was nothing to observe. "
            "Check that it wraps its model in DDP when launched with torchrun (for example, "
            "that it does not fall back to single-process training when WORLD_SIZE is set).",
            timed_out=timed_out,
        )
    return CheckResult(
        models=[Model(report=_failure_report(states, timed_out, interrupted, native or []))],
        timed_out=timed_out,
        interrupted=interrupted,
    )


def _model(m: dict[str, Any], report: Report | None = None) -> Model:
    """A model of a rank's report file (`m`), with `report` in place of the one it holds when given."""
    return Model(
        report=report if report is not None else Report.from_dict(m["report"]),
        site=m.get("site"),
        framework=m.get("framework", "torch"),
        module=m.get("module", ""),
    )


def _hung(folder: Path) -> list[Finding]:
    """The findings of the hang `watch` called before it stopped the job (`--on-hang stop`), from `hang.json`."""
    verdict = _read(folder / "hang.json") or {}
    return [Finding.from_dict(f) for f in verdict.get("findings") or []]


def _after_steps(
    models: list[dict[str, Any]],
    states: dict[int, RankState],
    timed_out: bool,
    native: list[str],
    *,
    watched: bool,
    hung: list[Finding],
) -> list[Model]:
    """The observed steps' reports, the first one with what failed while `check` followed the script after them
    (its findings go first: they ended the run; `hung`: a hang's verdict, when the ranks' files no longer tell)."""
    from ddp_doctor.analyze import diagnose_after_steps

    first, *rest = [Report.from_dict(m["report"]) for m in models]
    failed = diagnose_after_steps(
        first.diagnosis, states, timed_out=timed_out, native=native, watched=watched, hung=hung
    )
    reports = [Report.build(first.facts, failed), *rest]
    return [_model(m, r) for m, r in zip(models, reports)]


def _failure_report(
    states: dict[int, RankState], timed_out: bool, interrupted: int | None, native: list[str]
) -> Report:
    """A report from the ranks' own files: who failed first, how, and where the others were."""
    import torch

    from ddp_doctor.analyze import diagnose_failure

    meta = next((s.models[0] for s in states.values() if s.models), {})
    wraps = [s.wrap for s in states.values() if s.wrap is not None]
    # A sharded model's ranks publish no DDP model; they run this interpreter's torch.
    sharding = None if meta else next((s.sharding for s in states.values() if s.sharding is not None), None)
    facts = RunFacts(
        torch_version=meta.get("torch_version")
        or next((w.torch_version for w in wraps if w.torch_version), "")
        or (torch.__version__ if sharding is not None else ""),
        backend=meta.get("backend")
        or next((w.backend for w in wraps if w.backend), "")
        or next((s.backend for s in states.values() if s.backend), ""),
        world_size=max([s.world_size for s in states.values()] + [len(states)]),
        ddp_config=meta.get("ddp_config", {}),
        framework=meta.get("framework") or next((s.framework for s in states.values() if s.framework), "torch"),
        ddp_site=meta.get("site") or next((s.wrap.site for s in states.values() if s.wrap and s.wrap.site), None),
        interrupted=interrupted is not None,
        failed=True,
        parallelism=parallelism_of(sharding),
        sharding=sharding,
    )
    diagnosis = diagnose_failure(states, timed_out=timed_out, native=native, interrupted=interrupted is not None)
    return Report.build(facts, diagnosis)
