"""analyze: records in, one `Diagnosis` out (findings, the recommendation with its code, timing, figures). Pure
functions: no torch.distributed calls, and nothing from the exchange or the observation. Every finding is decided
through these entries, one per kind of input: `analyze_summary` (the exchange's `Summary`; `analyze(info, records)`,
which reduces hand-built records with the exchange's in-process model first, is `ddp_doctor.doctor.pipeline.analyze`),
and those of `analyze/diagnose.py` (a failed run's files and wrap records, an unwrapped or FSDP2 run, the followed
epochs, the verification run). Nothing edits a diagnosis after an entry returns it."""

from __future__ import annotations

import logging

from ddp_doctor.analyze.agreement import unsynced_steps
from ddp_doctor.analyze.causes import CAUSES
from ddp_doctor.analyze.coverage import compared
from ddp_doctor.analyze.detectors import DETECTORS
from ddp_doctor.analyze.diagnose import (
    diagnose_after_steps,
    diagnose_failure,
    diagnose_following,
    diagnose_sharded,
    diagnose_unwrapped,
    diagnose_verified,
)
from ddp_doctor.analyze.failures import failure_findings
from ddp_doctor.analyze.flight_recorder import first_divergence
from ddp_doctor.analyze.links import link_causes
from ddp_doctor.analyze.recommend import recommend
from ddp_doctor.analyze.shapes import explain_shape_error, refused_at_wrap
from ddp_doctor.analyze.sharded import verified_reshard
from ddp_doctor.analyze.sharded_failures import explain_fsdp2_crash, explain_meta_params
from ddp_doctor.analyze.snippets import with_code
from ddp_doctor.analyze.throughput import rank_timings
from ddp_doctor.analyze.usage import figures
from ddp_doctor.analyze.view import View
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Crash, Diagnosis, Timing
from ddp_doctor.core.records import CRASH_KINDS
from ddp_doctor.core.summary import Summary

__all__ = [
    "analyze_summary",
    "diagnose_after_steps",
    "diagnose_failure",
    "diagnose_following",
    "diagnose_sharded",
    "diagnose_unwrapped",
    "diagnose_verified",
    "explain_fsdp2_crash",
    "explain_meta_params",
    "explain_shape_error",
    "failure_findings",
    "first_divergence",
    "refused_at_wrap",
    "verified_reshard",
    "with_code",
]

logger = logging.getLogger(__name__)

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def _timing(summary: Summary, view: View) -> Timing:
    fwd, bwd, opt, step = summary.timing
    if step is None:
        return Timing()
    per_rank = rank_timings(view)
    group = summary.info.group_ranks
    if group:  # users read global ranks
        for t in per_rank:
            t.rank = group[t.rank] if t.rank < len(group) else t.rank
    return Timing(
        forward_s=fwd,
        backward_s=bwd,
        optimizer_s=opt,
        step_s=step,
        per_rank=per_rank,
        ranks_measured=summary.step_times.measured,
    )


def analyze_summary(summary: Summary) -> Diagnosis:
    """Diagnose the group from the exchange's `Summary`, the recommendation's code included. Time and memory do not
    depend on the world size."""
    info = summary.info
    view = View(summary)
    findings = [f for detect in DETECTORS for f in detect(view)]
    findings.sort(key=lambda f: _SEVERITY_ORDER[f.severity])
    _consistent_fixes(findings, summary.grads_measured, view)
    link_causes(findings)
    crashes = []
    for r in summary.examples["crashed"].ranks:
        meta = summary.metas[r]
        crashes.append(
            Crash(rank=r, step=meta["crash_step"], kind=CRASH_KINDS[meta["crash_kind"]], message=meta["crash_message"])
        )
    if info.group_ranks:
        # A DDP model over a subgroup: analysis ran in group ranks; users read global ranks.
        to_global = info.group_ranks
        for f in findings:
            f.ranks = [to_global[r] if 0 <= r < len(to_global) else r for r in f.ranks]
        for c in crashes:
            c.rank = to_global[c.rank] if 0 <= c.rank < len(to_global) else c.rank
    try:
        usage, gap = figures(summary, findings)
    except Exception:  # the figures are a view of the diagnosis: never lose the report over them
        logger.warning("ddp-doctor: could not compute the usage map and divergence curve", exc_info=True)
        usage, gap = None, None
    return Diagnosis(
        findings=findings,
        # The code for the recommendation, from the records alone: the flavour (which Lightning package, which
        # TrainingArguments fields) was recorded where the model was built.
        recommendation=with_code(recommend(view, findings), info.ddp_config, info.flavor),
        timing=_timing(summary, view),
        steps_observed=view.steps,
        crashes=crashes,
        usage_map=usage,
        divergence=gap,
        compared=compared(summary),
    )


_EXPLAINS_UNSYNCED = {
    Code.WRAPPER_BYPASS,
    Code.UNUSED_PARAMETERS,
    Code.GRAD_BLOCKED,
    Code.REDUCTION_ERROR,
    Code.FROZEN_AFTER_WRAP,
    Code.UNFROZEN_AFTER_WRAP,
    Code.RANK_DEPENDENT_GRAPH,
    Code.COLLECTIVE_MISMATCH,
    Code.STATIC_GRAPH_UNSAFE,
    Code.GRAD_SCALER_MISMATCH,
}


def _agreed(measured: dict[str, int]) -> str:
    """When the gradients were compared across the ranks, in words: what was measured, no more."""
    if measured.get("step") and measured.get("closure"):
        at = "and when optimizer.step() used them (at its start, or when a closure-based step returned)"
    elif measured.get("step"):
        at = "and when optimizer.step() began"
    elif measured.get("closure"):
        at = "and when optimizer.step() returned (its closure ran the backward inside it)"
    else:
        return "the gradients agreed after DDP's all-reduce at every step observed (no optimizer step was seen)"
    return f"the gradients agreed after DDP's all-reduce {at}, at every step observed"


def _consistent_fixes(findings: list, measured: dict[str, int], view: View) -> None:
    """A fix must not send the user to a finding the report does not have, nor claim more than was measured."""
    codes = {f.code for f in findings}
    agreed = _agreed(measured)
    for f in findings:
        causes = [c for c in CAUSES if c in codes]
        if f.code == Code.REPLICA_DIVERGENCE and causes and Code.GRADS_NOT_SYNCED not in codes:
            f.fix = (
                f"fix the cause: {', '.join(causes)} (see {'that finding' if len(causes) == 1 else 'those findings'}). "
                "Then restart from a checkpoint saved before the divergence, or re-broadcast rank 0's weights "
                "knowingly."
            )
        elif f.code == Code.REPLICA_DIVERGENCE and Code.GRADS_NOT_SYNCED not in codes:
            f.fix = (
                f"fix the cause named by the other findings; {agreed}, so "
                "the updates themselves differed (an extra synced pass on one rank, a rank-dependent optimizer "
                "setting, or weights changed outside the optimizer). Restart from a checkpoint saved before the "
                "divergence, or re-broadcast rank 0's weights knowingly."
                if codes & _EXPLAINS_UNSYNCED
                else f"the cause is unknown. {agreed[0].upper()}{agreed[1:]}, and none of the causes "
                "ddp-doctor looks for was seen: no gradients changed on some ranks after DDP's all-reduce "
                "(grads-changed-after-sync), the same optimizer settings on every rank at the steps observed "
                "(optimizer-differs), the same optimizer steps taken in lockstep (optimizer-step-skipped), "
                "identical replicas before the first step (replicas-differ-at-wrap), no write to the weights "
                "outside the optimizer on some ranks only (weights-changed-outside-optimizer). Look for what "
                "changes the weights per rank that these do not cover (an optimizer the check did not observe, "
                "a parameter replaced rather than written in place). Restart from a checkpoint saved before the "
                "divergence, or re-broadcast rank 0's weights knowingly."
            )
        # The sync was on (the detector's own fix names no_sync otherwise) and no finding explains the difference.
        if f.code == Code.GRADS_NOT_SYNCED and not unsynced_steps(view, f.steps) and not codes & _EXPLAINS_UNSYNCED:
            f.fix = (
                "gradients must be reduced by DDP before optimizer.step(): check that every rank runs the "
                "backward pass through the DDP model (not its .module), with the same parameters trainable, "
                "and that nothing edits .grad between backward and the optimizer step."
            )
