"""The analysis' entries beside the exchanged summary's (`analyze_summary`): one pure function per kind of input,
each returning a complete `Diagnosis`, its recommendation's code included. launch gathers the inputs (the ranks'
files, the wrap records, the optimizer watch, the followed epochs) and calls these; it decides no finding itself.

| input | entry |
|---|---|
| the exchange's `Summary` | `analyze_summary` (`analyze/__init__.py`) |
| the ranks' files of a run that could not exchange (`RankState` per rank, wrap records included) | `diagnose_failure` |
| a failure while `check` followed the script after its diagnosed steps | `diagnose_after_steps` |
| an optimizer that trained with no DDP (`UnwrappedRun`) | `diagnose_unwrapped` |
| an FSDP2 model (`ShardedRun`) | `diagnose_sharded` |
| the epoch ends followed (`FollowSummary`) | `diagnose_following` |
| a second run with the recommendation applied | `diagnose_verified` |

A later input never edits a diagnosis: these return a new one (`dataclasses.replace`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ddp_doctor.analyze.detectors import SHARDED_DETECTORS
from ddp_doctor.analyze.failures import failure_findings
from ddp_doctor.analyze.following_ends import following_findings, following_section, unchecked
from ddp_doctor.analyze.links import link_causes
from ddp_doctor.analyze.not_wrapped import (
    unwrapped_compared,
    unwrapped_findings,
    unwrapped_recommendation,
    unwrapped_unchecked,
)
from ddp_doctor.analyze.recommend import recommend_after_failure, verified_by_second_run
from ddp_doctor.analyze.run_facts import from_run
from ddp_doctor.analyze.sharded import sharded_recommendation
from ddp_doctor.analyze.sharded_coverage import sharded_compared, sharded_unchecked
from ddp_doctor.analyze.snippets import with_code
from ddp_doctor.analyze.view import run_detectors
from ddp_doctor.core.codes import SEVERITIES, Code
from ddp_doctor.core.findings import Diagnosis, Finding, Recommendation, Timing
from ddp_doctor.core.following import Following, FollowSummary, JoinedLoop
from ddp_doctor.core.phase import Phase
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.rankstate import RankState
from ddp_doctor.core.sharded_run import ShardedRun
from ddp_doctor.core.unwrapped_run import UnwrappedRun

__all__ = [
    "diagnose_after_steps",
    "diagnose_failure",
    "diagnose_following",
    "diagnose_sharded",
    "diagnose_unwrapped",
    "diagnose_verified",
]


def diagnose_failure(
    states: dict[int, RankState], *, timed_out: bool, native: Sequence[str] = (), interrupted: bool = False
) -> Diagnosis:
    """A run whose ranks could not exchange records, from each rank's own files: who failed first, how, where the
    others were (`analyze/failures.py`), or DDP's constructor refusing shapes that differ by rank
    (`analyze/shapes.py`, from the wrap records).

    Args:
        states: every rank's files, merged (`core.rankstate.read_rank_states`).
        timed_out: the supervisor's `--timeout` ran out.
        native: gloo's or NCCL's own error lines found in the job's output.
        interrupted: `ddp-doctor` was stopped by a signal: no findings, and a recommendation that says where the
            ranks were.
    """
    meta = next((s.models[0] for s in states.values() if s.models), {})
    ddp_config = meta.get("ddp_config", {})
    where = "; ".join(f"rank {r} at step {max(s.step, 0)}, {s.phase}" for r, s in sorted(states.items()))
    if interrupted:
        findings = []
        rec = Recommendation.unknown(
            "No recommendation: the run was interrupted before the ranks finished the observed steps. "
            f"Where they were: {where}."
        )
    else:
        findings = failure_findings(states, timed_out=timed_out, native=list(native))
        link_causes(findings)
        sharding = next((s.sharding for s in states.values() if s.sharding is not None), None)
        if not meta and sharding is not None:
            how = "replicates its model with FSDP2's replicate" if sharding.get("api") == "replicate" else ""
            rec = Recommendation.unknown(
                f"This job {how or 'shards its model with FSDP2 (fully_shard)'}, not DDP: there are no DDP flags "
                "to recommend, "
                "and the run failed before the ranks could compare what they saw. Fix the failure above and run "
                f"the check again. Where they were: {where}."
            )
        else:
            rec = with_code(recommend_after_failure(findings, ddp_config, where=where), ddp_config)
    return Diagnosis(
        findings=findings,
        recommendation=rec,
        timing=Timing(),
        steps_observed=min((max(s.step, 0) for s in states.values()), default=0),
    )


def diagnose_after_steps(
    steps: Diagnosis,
    states: dict[int, RankState],
    *,
    timed_out: bool,
    native: Sequence[str] = (),
    watched: bool = False,
    hung: Sequence[Finding] = (),
) -> Diagnosis:
    """The observed steps' diagnosis with what failed while `check` followed the script after them (`watched`: while
    `watch` let the job train on): the failure's findings first (they ended the run), and a following section that
    says so. `hung`: the findings of the hang `watch` called before it stopped the job, which lead when the ranks'
    files, read after the stop, no longer tell who waited."""
    failed = failure_findings(states, timed_out=timed_out, native=list(native)) or list(hung)
    world = max((s.world_size for s in states.values()), default=1)
    absent = sorted(set(range(world)) - set(states))
    failed_ranks = sorted({r for f in failed for r in f.ranks})
    cause = (
        (f"{rank_list(failed_ranks)}: " if failed_ranks else "")
        + ", ".join(dict.fromkeys(f.code for f in failed))
        + (" (the first findings)" if len(failed) > 1 else " (the first finding)")
        if failed
        else f"no rank here failed first, and this run folder holds no records of {rank_list(absent)} (ranks of "
        "another node: its own run folder, or its watch's output, says what happened to them)"
        if absent
        else "the ranks could not exchange records"
    )
    following = Following(
        epochs=0,
        limit_batches=0,
        epoch_ends=0,
        ended_by="a failure (the first finding)",
        seconds=0.0,
        loaders=[],
        note="The observed steps were diagnosed (the findings after the "
        + (f"first {len(failed)}" if len(failed) > 1 else "first")
        + "); the run then failed "
        + (
            "after the script had destroyed its process group on every rank: "
            if states and all(s.phase == Phase.TORN_DOWN.value for s in states.values())
            else "while it trained on under watch: "
            if watched
            else "while check followed it to its epoch end: "
        )
        + cause
        + ".",
    )
    findings = [*failed, *steps.findings]
    link_causes(findings)
    return dataclasses.replace(steps, findings=findings, following=following)


def diagnose_unwrapped(run: UnwrappedRun) -> Diagnosis:
    """An optimizer that trained parameters on several ranks with no DDP model: `model-not-wrapped`."""
    return Diagnosis(
        findings=unwrapped_findings(run),
        recommendation=unwrapped_recommendation(run),
        timing=Timing(),
        steps_observed=run.steps,
        unchecked=unwrapped_unchecked(run),
        compared=unwrapped_compared(run),
    )


def diagnose_sharded(run: ShardedRun) -> Diagnosis:
    """A model sharded with FSDP2 (`fully_shard`, or `replicate`): the findings of every detector registered for a
    sharded model's facts (`detectors.SHARDED_DETECTORS`), most severe first, and what the check says instead of
    flags."""
    findings = run_detectors(run, SHARDED_DETECTORS, from_run(run))
    findings.sort(key=lambda f: SEVERITIES.index(f.severity))
    link_causes(findings)
    return Diagnosis(
        findings=findings,
        recommendation=sharded_recommendation(run, errors=any(f.severity == "error" for f in findings)),
        timing=Timing(),
        steps_observed=run.steps,
        compared=sharded_compared(run),
        unchecked=sharded_unchecked(run),
    )


def diagnose_following(
    steps: Diagnosis,
    summary: FollowSummary | None,
    *,
    framework: str,
    epochs: int,
    limit: int,
    followed: bool,
    parallelism: str = "ddp",
    world: int = 0,
    stopped: bool = True,
    watched: bool = False,
    joined: JoinedLoop | None = None,
) -> Diagnosis:
    """The observed steps' diagnosis with what following the script through its epoch ends found
    (`analyze/following_ends.py`): its section, its findings in severity order, what went unchecked and the files
    written.

    Args:
        steps: the observed steps' diagnosis of a model over the whole world.
        summary: what every rank agreed following saw; None when the run ended before its observed steps did.
        framework: the framework that built the model (a fix in its words).
        epochs: `--follow-epochs`.
        limit: `--limit-batches`.
        followed: following was on (else only the counted passes' findings count).
        parallelism: the model's (`fsdp2`, `replicate`: the training loaders are compared here, not in the steps).
        world: the ranks of the model's group.
        stopped: the records were exchanged at the end of the observed steps (not at the script's own end, a
            crash or a destroyed process group before them: then nothing after them went unseen).
        watched: the job trains on after the observed steps under `watch` (what went unchecked says so).
        joined: the Join over its DDP model the script's loop runs in (its uneven inputs are handled).
    """
    section = following_section(summary, epochs=epochs, limit=limit) if followed else None
    steps_uneven = next((f for f in steps.findings if f.code == Code.UNEVEN_INPUTS), None)
    found = following_findings(
        summary,
        framework=framework,
        lengths_compared=steps_uneven is not None and (steps_uneven.severity == "error" or joined is not None),
        parallelism=parallelism,
        world=world,
        joined=joined,
    )
    if section is None:  # nothing followed: only the counted passes' findings
        found = [f for f in found if f.code == Code.UNEVEN_INPUTS]
    findings = steps.findings
    if found:
        order = {s: i for i, s in enumerate(SEVERITIES)}
        findings = sorted([*steps.findings, *found], key=lambda f: order.get(f.severity, len(order)))
    files = (list(summary.files), summary.files_unlisted) if summary is not None else None
    return dataclasses.replace(
        steps,
        findings=findings,
        following=section,
        unchecked=[
            *steps.unchecked,
            *unchecked(
                summary,
                epochs=epochs if stopped else None,
                limit=limit,
                steps=steps.steps_observed,
                watched=watched and stopped,
            ),
        ],
        files_written=files[0] if files else steps.files_written,
        files_unlisted=files[1] if files else steps.files_unlisted,
    )


def diagnose_verified(
    first: Diagnosis, *, applied: str, needed: int, second: Diagnosis | None, error: str | None = None
) -> Diagnosis:
    """The first run's diagnosis after a second run with its recommendation applied (`launch/verify.py`): the
    recommendation verified, or its reason saying what the second run showed (`verified_by_second_run`)."""
    rec = verified_by_second_run(first.recommendation, applied=applied, needed=needed, second=second, error=error)
    return dataclasses.replace(first, recommendation=rec)
