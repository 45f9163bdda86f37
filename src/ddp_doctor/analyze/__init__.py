"""analyze: records in, one `Diagnosis` out (findings, the recommendation with its code, timing, figures). Pure
functions: no torch.distributed calls, and nothing from the exchange or the observation. Every finding is decided
through these entries, one per kind of input: `analyze_summary` (the exchange's `Summary`; `analyze(info, records)`,
which reduces hand-built records with the exchange's in-process model first, is `ddp_doctor.doctor.pipeline.analyze`),
and those of `analyze/diagnose.py` (a failed run's files and wrap records, an unwrapped or FSDP2 run, the followed
epochs, the verification run). Nothing edits a diagnosis after an entry returns it."""

from __future__ import annotations

import logging

from ddp_doctor.analyze.coverage import compared, unreadable
from ddp_doctor.analyze.crashed_ranks import init_waited_for
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
from ddp_doctor.analyze.view import View, run_detectors
from ddp_doctor.analyze.view_facts import from_view
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
    "init_waited_for",
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
    findings = run_detectors(view, DETECTORS, from_view(view))
    findings.sort(key=lambda f: _SEVERITY_ORDER[f.severity])
    link_causes(findings)
    crashes = []
    for r in summary.examples["crashed"].ranks:
        meta = summary.metas[r]
        crashes.append(
            Crash(
                rank=r,
                step=meta["crash_step"],
                kind=CRASH_KINDS[meta["crash_kind"]],
                message=meta["crash_message"],
                site=meta.get("crash_site", ""),
            )
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
        unchecked=unreadable(summary),
    )
