"""analyze() is pure: hand-built records in, findings and a recommendation out, no process group anywhere."""

from __future__ import annotations

import json

import pytest
import torch
from purerecords import ALL, NAMES, SHAPES, info, no_distributed, record  # noqa: F401 (the fixture)

from ddp_doctor.core.records import Flavor, StepCounters
from ddp_doctor.doctor.pipeline import analyze
from ddp_doctor.report import Report, RunFacts


def codes(diagnosis) -> set[str]:
    return {f.code for f in diagnosis.findings}


def names(diagnosis, code: str) -> list[str]:
    return next(f for f in diagnosis.findings if f.code == code).param_names


def test_clean_run_has_no_findings_and_a_verified_recommendation() -> None:
    records = [record(0, ALL), record(1, ALL)]
    d = analyze(info(), records)
    assert codes(d) == set()
    rec = d.recommendation  # the analysis renders the code before it returns the diagnosis
    assert (rec.find_unused_parameters, rec.static_graph, rec.freeze_before_wrap, rec.verified) == (
        False,
        False,
        [],
        True,
    )
    assert "find_unused_parameters=False" in rec.render["torch"]
    assert "ddp_find_unused_parameters=False" in rec.render["transformers"]
    assert "DistributedDataParallelKwargs(find_unused_parameters=False" in rec.render["accelerate"]
    assert "DDPStrategy(find_unused_parameters=False" in rec.render["lightning"]
    assert d.steps_observed == 3 and d.timing.step_s == pytest.approx(0.03)


def test_never_used_param_with_default_flags_is_an_error_and_frozen_before_wrap() -> None:
    used = [[1, 1, 1, 0]] * 3
    records = [record(0, used), record(1, used)]
    d = analyze(info(), records)
    assert codes(d) == {"unused-parameters"}
    f = d.findings[0]
    assert f.severity == "error" and f.param_names == ["head_b.weight"] and f.params[0].numel == 8
    assert d.recommendation.freeze_before_wrap == ["head_b.weight"]
    rec = d.recommendation
    assert "get_parameter(name).requires_grad_(False)" in rec.render["torch"]


def test_the_snippets_follow_the_recorded_flavor_not_the_process() -> None:
    """Analysis and rendering read the flavour recorded with the model, whatever this process imported."""
    records = [record(0, ALL), record(1, ALL)]
    old = info(
        flavor=Flavor(
            lightning_package="pytorch_lightning",
            transformers_version="4.57.6",
            training_arguments_fields=["ddp_find_unused_parameters"],
        )
    )
    rec = analyze(old, records).recommendation
    assert "from pytorch_lightning import Trainer" in rec.render["lightning"]
    new = info()
    rec = analyze(new, records).recommendation
    assert "from lightning.pytorch import Trainer" in rec.render["lightning"]


def test_used_set_changing_between_steps_needs_find_unused() -> None:
    used = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    cfg = {"find_unused_parameters": True, "static_graph": False, "gradient_as_bucket_view": False}
    d = analyze(info(ddp_config=cfg), [record(0, used), record(1, used)])
    assert codes(d) == {"dynamic-graph"}
    assert d.findings[0].severity == "info" and d.findings[0].steps == [0, 2]
    assert (d.recommendation.find_unused_parameters, d.recommendation.static_graph) == (True, False)
    assert d.recommendation.verified


def test_dynamic_graph_under_static_graph_is_unsafe() -> None:
    used = [[1, 1, 1, 0], [1, 1, 1, 1]]
    cfg = {"find_unused_parameters": False, "static_graph": True}
    d = analyze(info(ddp_config=cfg), [record(0, used), record(1, used)])
    assert codes(d) == {"dynamic-graph", "static-graph-unsafe"}
    assert all(f.severity == "error" for f in d.findings)


def test_stable_rank_dependent_graph_gets_static_graph() -> None:
    cfg = {"find_unused_parameters": True, "static_graph": False}
    d = analyze(info(ddp_config=cfg), [record(0, ALL), record(1, [[1, 1, 1, 0]] * 3)])
    assert codes(d) == {"rank-dependent-graph"}
    assert d.findings[0].ranks == [1] and names(d, "rank-dependent-graph") == ["head_b.weight"]
    assert (d.recommendation.find_unused_parameters, d.recommendation.static_graph) == (False, True)


def test_an_info_finding_prints_no_fix_the_script_already_applies() -> None:
    """The script's flags already cope (severity info): no "build DDP with ..." naming the flags it has, in the
    JSON and in the text; on default flags the same finding is an error and keeps its fix."""
    lacking = [record(0, ALL), record(1, [[1, 1, 1, 0]] * 3)]
    for cfg in ({"find_unused_parameters": True, "static_graph": False}, {"static_graph": True}):
        new = info(ddp_config=cfg)
        d = analyze(new, lacking)
        (f,) = d.findings
        assert (f.code, f.severity, f.fix) == ("rank-dependent-graph", "info", ""), cfg
        report = Report.build(RunFacts.of_model(new, world_size=len(lacking), backend="gloo"), d)
        assert report.to_dict()["findings"][0]["fix"] == ""
        assert "fix:" not in str(report) and "INFO rank-dependent-graph" in str(report)
    d = analyze(info(), lacking)
    assert d.findings[0].severity == "error" and "static_graph=True" in d.findings[0].fix

    dynamic = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    new = info(ddp_config={"find_unused_parameters": True, "static_graph": False})
    d = analyze(new, [record(0, dynamic), record(1, dynamic)])
    assert (d.findings[0].code, d.findings[0].severity, d.findings[0].fix) == ("dynamic-graph", "info", "")
    d = analyze(info(), [record(0, dynamic), record(1, dynamic)])
    assert "find_unused_parameters=True" in next(f for f in d.findings if f.code == "dynamic-graph").fix


def test_grads_that_differ_across_ranks_are_named_with_ranks_and_steps() -> None:
    grad = torch.zeros(3, 4, 2, dtype=torch.float64)
    other = grad.clone()
    other[2, 1] = 5.0
    d = analyze(info(), [record(0, ALL, grad=grad), record(1, ALL, grad=other)])
    f = next(f for f in d.findings if f.code == "grads-not-synced")
    assert (f.param_names, f.ranks, f.steps) == (["trunk.bias"], [0, 1], [2])


def test_missing_grad_on_every_rank_is_in_sync() -> None:
    grad = torch.full((3, 4, 2), float("nan"), dtype=torch.float64)
    d = analyze(info(), [record(0, ALL, grad=grad), record(1, ALL, grad=grad.clone())])
    assert "grads-not-synced" not in codes(d)


def test_weights_that_already_differ_at_entry() -> None:
    w = torch.zeros(4, 4, 2, dtype=torch.float64)
    w1 = w.clone()
    w1[:, 0, 0] = 1.0
    d = analyze(info(), [record(0, ALL, weights=w), record(1, ALL, weights=w1)])
    f = next(f for f in d.findings if f.code == "replica-divergence")
    # At entry, not after step 0 (the steps are the same: the label tells the two apart).
    assert f.param_names == ["trunk.weight"] and f.labels == {"apart_since": "start"}, f


def test_identical_inputs_on_every_rank() -> None:
    same = torch.full((3, 2), 7.0, dtype=torch.float64)
    d = analyze(info(), [record(0, ALL, inputs=same), record(1, ALL, inputs=same.clone())])
    assert codes(d) == {"identical-inputs-across-ranks"}
    assert "DistributedSampler" in d.findings[0].fix


def test_buffers_that_differ() -> None:
    b = torch.zeros(3, 1, 2, dtype=torch.float64)
    b1 = b.clone()
    b1[1:] = 3.0
    d = analyze(info(), [record(0, ALL, buffers=b), record(1, ALL, buffers=b1)])
    f = next(f for f in d.findings if f.code == "buffer-divergence")
    assert f.param_names == ["norm.running_mean"] and f.steps == [1, 2]


def test_frozen_and_unfrozen_after_wrap() -> None:
    trainable = [[1, 1, 0, 1]] * 3
    used = [[1, 1, 0, 1]] * 3
    d = analyze(
        info(trainable_at_wrap=[True, True, True, False]), [record(r, used, trainable=trainable) for r in range(2)]
    )
    assert {"frozen-after-wrap", "unfrozen-after-wrap"} <= codes(d)
    assert names(d, "frozen-after-wrap") == ["head_a.weight"]
    assert names(d, "unfrozen-after-wrap") == ["head_b.weight"]
    assert "head_a.weight" in d.recommendation.freeze_before_wrap


def test_nothing_trainable_at_a_step() -> None:
    trainable = [[1, 1, 1, 1], [0, 0, 0, 0]]
    used = [[1, 1, 1, 1], [0, 0, 0, 0]]
    d = analyze(info(), [record(r, used, trainable=trainable) for r in range(2)])
    f = next(f for f in d.findings if f.code == "no-trainable-parameters")
    assert f.steps == [1]


def test_bypass_is_reported_with_call_site() -> None:
    c = StepCounters(bypass_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1).as_list()
    records = [record(r, ALL, counters=torch.tensor([c] * 3)) for r in range(2)]
    records[0].bypass_sites = ["train.py:42"]
    d = analyze(info(), records)
    f = next(f for f in d.findings if f.code == "wrapper-bypass")
    assert f.severity == "error" and f.sites == ["train.py:42"] and f.steps == [0, 1, 2]


def test_reduction_error_names_the_params_without_grad_in_the_last_step() -> None:
    used = [[1, 1, 1, 0]]
    d = analyze(info(), [record(r, used, crash="reduction-error", crash_step=1) for r in range(2)])
    f = next(f for f in d.findings if f.code == "reduction-error")
    assert f.param_names == ["head_b.weight"] and f.steps == [1] and f.ranks == [0, 1]
    assert [c.kind for c in d.crashes] == ["reduction-error"] * 2


def test_find_unused_left_on_when_nothing_is_unused() -> None:
    cfg = {"find_unused_parameters": True, "static_graph": False}
    d = analyze(info(ddp_config=cfg), [record(0, ALL), record(1, ALL)])
    assert codes(d) == {"find-unused-unneeded"}
    assert not d.recommendation.find_unused_parameters


def test_json_round_trip_of_the_report_shape() -> None:
    from ddp_doctor.report import Report

    d = analyze(info(), [record(0, [[1, 1, 1, 0]] * 2), record(1, [[1, 1, 1, 0]] * 2)])
    report = Report.build(RunFacts.of_model(info(), world_size=2, backend="gloo"), d)
    data = report.to_dict()
    assert data["schema"] == "ddp-doctor/report@2"
    assert set(data) >= {
        "schema",
        "tool_version",
        "torch_version",
        "backend",
        "world_size",
        "steps_observed",
        "ddp_config",
        "findings",
        "recommendation",
        "timing",
    }
    assert set(data["findings"][0]) == {
        *("code", "severity", "title", "detail", "params", "ranks", "steps", "fix"),  # the @1 keys, kept
        *("caused_by", "explains", "sites", "measured", "labels", "ruled_out"),  # @2's evidence
    }
    assert set(data["recommendation"]) == {
        "find_unused_parameters",
        "static_graph",
        "gradient_as_bucket_view",
        "freeze_before_wrap",
        "reason",
        "verified",
        "render",
    }
    assert "unused-parameters" in str(report) and "head_b.weight (8)" in str(report)
    # The check parent reads the ranks' JSON back with from_dict: nothing may be lost on the way.
    back = Report.from_dict(json.loads(json.dumps(data)))
    assert back.to_dict() == data
    assert back.findings == report.findings and back.recommendation == report.recommendation


def test_after_a_failure_only_a_rank_dependent_set_supports_flags_and_none_are_shown_otherwise() -> None:
    from ddp_doctor.analyze.recommend import recommend_after_failure
    from ddp_doctor.core.findings import Finding, ParamRef

    by_rank = Finding(
        code="rank-dependent-graph",
        severity="error",
        title="t",
        detail="d",
        params=[ParamRef("aux.weight", 32), ParamRef("aux.bias", 2)],
        ranks=[0, 1],
        steps=[0],
        fix="f",
    )
    rec = recommend_after_failure([by_rank], {"find_unused_parameters": False}, where="rank 0 at step 1")
    assert (rec.find_unused_parameters, rec.static_graph, rec.freeze_before_wrap) == (True, False, [])
    assert rec.flags_known and not rec.verified and "aux.weight, aux.bias" in rec.reason
    assert "flags_known" not in rec.to_dict()

    unknown = recommend_after_failure([], {"find_unused_parameters": False}, where="rank 0 at step 1, backward")
    assert not unknown.flags_known and unknown.to_dict()["flags_known"] is False
    assert "Fix the failure above" not in unknown.reason and "rank 0 at step 1, backward" in unknown.reason
    d = analyze(info(), [record(0, [[1] * 4]), record(1, [[1] * 4])])
    data = Report.build(RunFacts.of_model(info(), world_size=2, backend="gloo"), d).to_dict()
    report = Report.from_dict({**data, "recommendation": unknown.to_dict()})
    text = str(report)
    assert "No DDP flags to recommend" in text and "Recommendation (" not in text, text
