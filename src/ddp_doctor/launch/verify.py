"""The verification run: `check` applies the flags it recommends in a second run of the script, when the first run
could not show them working.

A run whose observed steps ended early (a crash: DDP's own error on the ranks, say; or a script that ends before
`--steps`) gives a recommendation that no observed step ran under. `check` then runs the script once more with the
recommended flags (as `--ddp-kwargs` would, and the parameters to freeze), observes as many steps as the first run
wanted, and marks the recommendation verified when that run ends with no error: every step it saw synced, on every
rank. Otherwise the recommendation stays "not yet verified" and its reason says what the second run showed.

The second run's own output (the script's prints) goes to a file, not to the terminal; it follows no epoch end (the
first run did that), so it costs the observed steps and the start-up.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from ddp_doctor.launch.config import RankConfig
from ddp_doctor.launch.outcome import CheckResult
from ddp_doctor.report.model import Report

__all__ = ["needs_reshard_verification", "needs_verification", "verify_recommendation", "verify_reshard"]

_FLAGS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")


def needs_verification(result: CheckResult, steps: int) -> bool:
    """Whether the first run's recommendation asks for a verification run: one DDP model, flags known, not verified,
    different from what the script ran with, and observed steps that ended before `steps` (a crash or a short
    script) without a timeout or an interruption."""
    report = result.report
    if report is None or len(result.models) != 1 or result.error or result.timed_out:
        return False
    if result.interrupted is not None or report.interrupted or not report.ddp_built:
        return False
    rec = report.recommendation
    if not rec.flags_known or rec.verified or report.steps_observed >= steps:
        return False
    changed = any(bool(report.ddp_config.get(k, False)) != v for k, v in rec.ddp_kwargs.items())
    return changed or bool(rec.freeze_before_wrap)


def verify_recommendation(
    result: CheckResult, config: RankConfig, run: Callable[[RankConfig], CheckResult]
) -> CheckResult | None:
    """Run the script again with the first run's recommendation applied, and mark it verified when that run is clean.

    Args:
        result: the first run's result; its report is replaced by one whose recommendation says what the second
            run showed (`analyze.diagnose_verified`).
        config: what the first run's ranks were told (the user's `--ddp-kwargs` and `--steps` among it).
        run: starts a run with a config and returns its result (`run_check` with the script's namespace).

    Returns:
        The verification run's result, or None when none was needed.
    """
    if not needs_verification(result, config.steps):
        return None
    report = result.report
    rec = report.recommendation
    kwargs = {**config.ddp_kwargs, **rec.ddp_kwargs}
    freeze = sorted({*config.freeze_before_wrap, *rec.freeze_before_wrap})
    second = run(replace(config, ddp_kwargs=kwargs, freeze_before_wrap=freeze, follow_epochs=0))
    applied = json.dumps({**rec.ddp_kwargs, **({"freeze_before_wrap": freeze} if freeze else {})})
    crashed = bool(report.crashes) or report.worst_severity() == "error"
    # Past the step where the first run failed (a crash), or as many steps as it saw (a script that ended early).
    needed = min(config.steps, max(2, report.steps_observed + (1 if crashed else 0)))
    if second.interrupted is not None:
        result.interrupted = second.interrupted
        return second
    check = second.report
    from ddp_doctor.analyze import diagnose_verified  # torch comes with the analysis: only when a run is verified

    verified = diagnose_verified(
        report.diagnosis,
        applied=applied,
        needed=needed,
        second=check.diagnosis if check is not None else None,
        error=second.error,
    )
    result.models[0] = replace(result.models[0], report=Report.build(report.facts, verified))
    return second


def needs_reshard_verification(result: CheckResult) -> bool:
    """Whether the first run advised `reshard_after_forward=False` for a sharded module, not yet verified."""
    report = result.report
    if report is None or len(result.models) != 1 or result.error or result.timed_out or result.interrupted:
        return False
    return report.recommendation.reshard is not None and not report.recommendation.verified


def verify_reshard(
    result: CheckResult, config: RankConfig, run: Callable[[RankConfig], CheckResult]
) -> CheckResult | None:
    """Run the script again with the advised module's `fully_shard` call made with `reshard_after_forward=False`,
    and mark the advice verified when that run counts fewer all-gathers per step (one per forward and backward)
    and finds the same codes.
    Returns the second run's result, or None when none was needed."""
    if not needs_reshard_verification(result):
        return None
    report = result.report
    rec = report.recommendation
    call = int(rec.reshard["call"])
    second = run(replace(config, reshard_off=sorted({*config.reshard_off, call}), follow_epochs=0))
    if second.interrupted is not None:
        result.interrupted = second.interrupted
        return second
    check = second.report
    gathers = (check.sharding or {}).get("all_gathers_per_step") if check is not None else None
    same = check is not None and check.codes == report.codes
    error = second.error or (None if check is not None else "no report")
    from ddp_doctor.analyze import verified_reshard

    new = verified_reshard(rec, gathers, same, error)
    diagnosis = replace(report.diagnosis, recommendation=new)
    result.models[0] = replace(result.models[0], report=Report.build(report.facts, diagnosis))
    return second
