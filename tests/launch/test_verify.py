"""The verification run's rule (`launch/verify.py`) on hand-built results: when it runs, what it applies, and what a
second run must show for the recommendation to read verified. The real runs are in `test_check_failures.py`."""

from __future__ import annotations

from ddp_doctor.core.findings import Finding, Recommendation, Timing
from ddp_doctor.launch.config import RankConfig
from ddp_doctor.launch.outcome import CheckResult, Model
from ddp_doctor.launch.verify import needs_verification, verify_recommendation
from ddp_doctor.report.model import Report

SCRIPT_FLAGS = {"find_unused_parameters": True, "static_graph": False, "gradient_as_bucket_view": False}


def _result(
    steps: int, *, rec: Recommendation | None = None, errors: int = 0, code: str = "rank-crashed"
) -> CheckResult:
    rec = rec or Recommendation(
        find_unused_parameters=False,
        static_graph=False,
        gradient_as_bucket_view=False,
        freeze_before_wrap=[],
        reason="find_unused_parameters=False is correct and cheapest.",
        verified=False,
    )
    title = "rank 1 crashed" if code == "rank-crashed" else f"{code} on rank 1"
    findings = [Finding(code=code, severity="error", title=title, detail="d")] * errors
    report = Report(
        tool_version="0",
        torch_version="0",
        backend="gloo",
        world_size=2,
        steps_observed=steps,
        ddp_config=dict(SCRIPT_FLAGS),
        findings=findings,
        recommendation=rec,
        timing=Timing(),
    )
    return CheckResult(models=[Model(report=report)])


def test_only_runs_whose_observed_steps_ended_early_with_advice_to_check_are_verified() -> None:
    assert needs_verification(_result(3), steps=8)
    assert not needs_verification(_result(8), steps=8)  # the full steps: the user's own run with the flags verifies
    assert not needs_verification(_result(3, rec=Recommendation.unknown("nothing known")), steps=8)
    same = Recommendation(**{**SCRIPT_FLAGS, "freeze_before_wrap": [], "reason": "r", "verified": False})
    assert not needs_verification(_result(3, rec=same), steps=8)  # nothing to apply
    timed_out = _result(3)
    timed_out.timed_out = True
    assert not needs_verification(timed_out, steps=8)


def test_a_clean_second_run_on_as_many_steps_verifies_the_recommendation() -> None:
    first, configs = _result(3), []

    def run(config: RankConfig) -> CheckResult:
        configs.append(config)
        return _result(3)

    config = RankConfig(target="train.py", steps=8, ddp_kwargs={"bucket_cap_mb": 50}, follow_epochs=1)
    assert verify_recommendation(first, config, run) is not None
    applied = configs[0]
    assert applied.ddp_kwargs == {"bucket_cap_mb": 50, "find_unused_parameters": False, "static_graph": False,
                                  "gradient_as_bucket_view": False}  # fmt: skip
    assert applied.follow_epochs == 0 and applied.steps == 8
    rec = first.report.recommendation
    assert rec.verified and rec.verification["outcome"] == "verified" and rec.verification["steps_observed"] == 3


def test_a_second_run_that_fails_leaves_it_unverified_and_says_why() -> None:
    # The flags failed (a crash, or a used set they do not cope with): advice proven wrong is withdrawn, its flags
    # unknown (null in the JSON), the reason saying what was tried.
    first = _result(3)
    verify_recommendation(first, RankConfig(target="train.py"), lambda _c: _result(3, errors=1))
    rec = first.report.recommendation
    assert not rec.verified and not rec.flags_known, rec
    assert rec.verification["outcome"] == "refuted" and rec.verification["errors"] == ["rank-crashed"], rec

    # An error flags cannot fix (gradients clipped on rank 0 only): the flags ran, they stay, unverified.
    other = _result(3)
    verify_recommendation(
        other, RankConfig(target="train.py"), lambda _c: _result(3, errors=1, code="grads-changed-after-sync")
    )
    rec = other.report.recommendation
    assert not rec.verified and rec.flags_known and rec.find_unused_parameters is False, rec
    assert rec.verification["outcome"] == "unconfirmed", rec
    assert rec.verification["errors"] == ["grads-changed-after-sync"], rec

    crashed = _result(2, errors=1)  # past the step where the first run failed: at least 3 steps
    verify_recommendation(crashed, RankConfig(target="train.py"), lambda _c: _result(2))
    rec = crashed.report.recommendation
    assert not rec.verified and rec.verification["outcome"] == "unconfirmed", rec
    assert (rec.verification["steps_observed"], rec.verification["steps_needed"], rec.verification["errors"]) == (
        2,
        3,
        [],
    )
