"""analyze: records in, findings and a recommendation out. A pure function: no torch.distributed calls."""

from __future__ import annotations

import statistics

from ddp_doctor.analyze.findings import DETECTORS
from ddp_doctor.analyze.recommend import recommend
from ddp_doctor.analyze.view import View
from ddp_doctor.records import CRASH_KINDS, ModelInfo, RankRecord
from ddp_doctor.report.model import Crash, Diagnosis, Timing

__all__ = ["analyze"]

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def _timing(v: View) -> Timing:
    rows = [r.timing[s] for r in v.records for s in range(v.steps)]
    if not rows:
        return Timing()
    fwd, bwd, opt = (statistics.median(float(row[i]) for row in rows) for i in range(3))
    return Timing(forward_s=fwd, backward_s=bwd, optimizer_s=opt,
                  step_s=statistics.median(float(row.sum()) for row in rows))


def analyze(info: ModelInfo, records: list[RankRecord]) -> Diagnosis:
    """Diagnose every rank's records.

    Args:
        info: the model as DDP wrapped it (rank 0's view).
        records: one `RankRecord` per rank, in rank order.

    Returns:
        A `Diagnosis`: findings (errors first), the recommendation, per-step timing and any crashes.
    """
    view = View(info, records)
    findings = [f for detect in DETECTORS for f in detect(view)]
    findings.sort(key=lambda f: _SEVERITY_ORDER[f.severity])
    _consistent_fixes(findings)
    crashes = [Crash(rank=r.rank, step=r.crash_step, kind=CRASH_KINDS[r.crash_kind], message=r.crash_message)
               for r in records if r.crash_kind]
    if info.group_ranks:
        # A DDP model over a subgroup: analysis ran in group ranks; users read global ranks.
        to_global = info.group_ranks
        for f in findings:
            f.ranks = [to_global[r] if 0 <= r < len(to_global) else r for r in f.ranks]
        for c in crashes:
            c.rank = to_global[c.rank] if 0 <= c.rank < len(to_global) else c.rank
    return Diagnosis(findings=findings, recommendation=recommend(view, findings), timing=_timing(view),
                     steps_observed=view.steps, crashes=crashes)


_EXPLAINS_UNSYNCED = {"wrapper-bypass", "unused-parameters", "grad-blocked", "reduction-error", "frozen-after-wrap",
                      "unfrozen-after-wrap", "rank-dependent-graph", "collective-mismatch", "static-graph-unsafe",
                      "grad-scaler-mismatch"}


def _consistent_fixes(findings: list) -> None:
    """A fix must not send the user to a finding the report does not have."""
    codes = {f.code for f in findings}
    for f in findings:
        if f.code == "replica-divergence" and "grads-not-synced" not in codes:
            f.fix = ("fix the cause named by the other findings; the gradients agreed at every optimizer step, so "
                     "the updates themselves differed (an extra synced pass on one rank, a rank-dependent optimizer "
                     "setting, or weights changed outside the optimizer). Restart from a checkpoint saved before the "
                     "divergence, or re-broadcast rank 0's weights knowingly."
                     if codes & _EXPLAINS_UNSYNCED else
                     "the gradients agreed at every optimizer step, so the updates themselves differed: look for a "
                     "rank-dependent optimizer setting or learning rate, or weights changed outside the optimizer. "
                     "Restart from a checkpoint saved before the divergence, or re-broadcast rank 0's weights "
                     "knowingly.")
        if f.code == "grads-not-synced" and not codes & _EXPLAINS_UNSYNCED:
            f.fix = ("gradients must be reduced by DDP before optimizer.step(): check that every rank runs the "
                     "backward pass through the DDP model (not its .module), with the same parameters trainable, "
                     "and that nothing edits .grad between backward and the optimizer step.")

