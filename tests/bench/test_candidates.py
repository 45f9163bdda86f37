"""Candidate configurations and the noise rule of `ddp-doctor bench`, on hand-built reports (no processes)."""

from __future__ import annotations

from ddp_doctor.bench.candidates import Config, candidates
from ddp_doctor.core.findings import Finding, Recommendation, Timing
from ddp_doctor.report.model import Report


def _report(codes: list[str], *, used: dict, rec: dict, freeze: list[str] = ()) -> Report:
    findings = [Finding(code=c, severity="warning", title=c, detail="") for c in codes]
    return Report(
        tool_version="0",
        torch_version="2.13",
        backend="gloo",
        world_size=2,
        steps_observed=8,
        ddp_config={"bucket_cap_mb": 25.0, **used},
        findings=findings,
        recommendation=Recommendation(
            **{"find_unused_parameters": False, "static_graph": False, "gradient_as_bucket_view": False, **rec},
            freeze_before_wrap=list(freeze),
            reason="",
            verified=False,
        ),
        timing=Timing(),
    )


def test_all_used_builds_every_flag_combination() -> None:
    names = [n for n, _ in candidates(_report(["find-unused-unneeded"], used={"find_unused_parameters": True}, rec={}))]
    assert names[:2] == ["user", "recommended"]
    assert "static_graph" in names and "recommended+bucket_view" in names and "recommended+bucket_10mb" in names
    assert "defaults" not in names  # identical to the recommendation here, so not run twice


def test_unused_params_rule_out_both_flags_off_and_keep_freeze() -> None:
    built = dict(
        candidates(_report(["unused-parameters"], used={}, rec={"static_graph": False}, freeze=["head.weight"]))
    )
    assert built["recommended"].freeze_before_wrap == ("head.weight",)
    assert built["user"] == Config()  # the script's flags: both off, which cannot work
    assert "defaults" not in built  # same as user
    assert built["static_graph"].static_graph and built["find_unused"].find_unused_parameters


def test_dynamic_graph_rules_out_static_graph_and_outside_forward_rules_out_find_unused() -> None:
    dynamic = dict(
        candidates(_report(["dynamic-graph"], used={"static_graph": True}, rec={"find_unused_parameters": True}))
    )
    assert "static_graph" not in dynamic and "defaults" not in dynamic
    outside = dict(candidates(_report(["used-outside-forward"], used={}, rec={"static_graph": True})))
    assert "find_unused" not in outside
