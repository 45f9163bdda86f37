"""Which findings are consequences of which (`analyze/links.py`), on hand-built findings: decided from codes and
parameters only; every finding kept; the causes first when the report groups them (`by_cause`)."""

from __future__ import annotations

from ddp_doctor.analyze.links import link_causes
from ddp_doctor.core.findings import Finding, ParamRef, by_cause

HEAD = [ParamRef("regress.0.weight", 8), ParamRef("regress.0.bias", 2)]
BODY = [ParamRef("encoder.weight", 16)]


def _f(code: str, severity: str = "error", params=(), ranks=(0, 1), **labels: str) -> Finding:
    return Finding(
        code=code, severity=severity, title=code, detail="", params=list(params), ranks=list(ranks), labels=labels
    )


def test_a_head_that_never_reaches_the_loss_explains_the_crash_and_the_drift() -> None:
    found = [
        _f("reduction-error", params=HEAD),
        _f("unused-parameters", params=HEAD),
        _f("grads-not-synced", params=BODY),
        _f("replica-divergence", params=BODY),
    ]
    link_causes(found)
    assert [f.caused_by for f in found] == [
        ["unused-parameters"],
        [],
        ["unused-parameters", "reduction-error"],
        ["unused-parameters", "reduction-error", "grads-not-synced"],
    ]
    grouped = by_cause(found)
    assert [(c.code, [x.code for x in rest]) for c, rest in grouped] == [
        ("unused-parameters", ["reduction-error", "grads-not-synced", "replica-divergence"])
    ]
    assert found[0].to_dict()["caused_by"] == ["unused-parameters"] and found[1].to_dict()["caused_by"] == []
    assert found[1].explains == ["reduction-error", "grads-not-synced", "replica-divergence"]
    assert found[0].explains == ["grads-not-synced", "replica-divergence"] and found[3].explains == []


def test_a_crash_naming_other_parameters_and_a_mode_difference_stay_causes_of_their_own() -> None:
    found = [
        _f("reduction-error", params=BODY),
        _f("unused-parameters", severity="warning", params=HEAD),
        _f("replica-divergence", severity="warning"),  # modes differ: no parameters
    ]
    link_causes(found)
    assert [f.caused_by for f in found] == [[], [], []]
    assert [c.code for c, _ in by_cause(found)] == ["reduction-error", "unused-parameters", "replica-divergence"]


def test_a_rank_aborted_by_a_mismatched_collective_follows_from_the_mismatch() -> None:
    found = [
        _f("collective-mismatch"),
        _f("rank-crashed", ranks=[1], kind="signal", signal="SIGABRT"),
        _f("rank-crashed", ranks=[2], kind="signal", signal="SIGABRT"),
    ]
    link_causes(found)
    assert [f.caused_by for f in found] == [[], ["collective-mismatch"], []]


def test_a_rank_aborted_after_a_sharded_collective_some_ranks_ran_follows_from_it() -> None:
    """A gather, a forward or a state_dict() on some ranks only puts FSDP2's all-gathers out of step; gloo aborts
    the rank that meets the wrong size. A rank killed (out of memory) or one that raised its own error is not
    explained by it."""
    for cause in ("state-gather-some-ranks", "sharded-forward-some-ranks", "sharded-checkpoint-incomplete"):
        found = [
            _f(cause),
            _f("rank-crashed", ranks=[1], kind="signal", signal="SIGABRT"),
            _f("rank-crashed", ranks=[0], kind="signal", signal="SIGKILL"),
            _f("rank-crashed", ranks=[0], kind="raised", exception="ValueError"),
        ]
        link_causes(found)
        assert [f.caused_by for f in found] == [[], [cause], [], []], cause
        assert [c.code for c, _ in by_cause(found)] == [cause, "rank-crashed", "rank-crashed"]


def test_a_warning_cause_of_an_error_reads_before_an_error_with_no_consequence() -> None:
    found = [
        _f("wrapper-bypass", params=BODY),
        _f("reduction-error", params=HEAD),
        _f("frozen-after-wrap", "warning", HEAD),
    ]
    link_causes(found)
    assert [c.code for c, _ in by_cause(found)] == ["wrapper-bypass", "frozen-after-wrap"]
