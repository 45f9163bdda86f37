"""A run whose ranks all failed the same way, read from the ranks' own files (hand-built `RankState`s): one joint
finding, the flags DDP's error calls for, and a recommendation without flags that says so with nulls (issue #32)."""

from __future__ import annotations

import json

from ddp_doctor.analyze.failures import failure_findings
from ddp_doctor.analyze.recommend import recommend_after_failure
from ddp_doctor.core.findings import Recommendation
from ddp_doctor.core.rankfiles import ExplainedError, Outcome, RaisedError
from ddp_doctor.core.rankstate import RankState

TWICE = (
    "DDP failed on rank {r}: with find_unused_parameters=True a parameter was marked ready twice. These parameters "
    "got a gradient but are not part of the graph of DDP's forward outputs, because they are used outside DDP's "
    "forward: head.bias. Fix: build DDP with static_graph=True and find_unused_parameters=False, or compute them "
    "inside forward."
)


def _crashed(rank: int, params: list[str], code: str = "used-outside-forward", step: int = 0) -> RankState:
    explained = ExplainedError(code=code, params=params, message=TWICE.format(r=rank), numels=[2] * len(params))
    raised = RaisedError(
        type="RuntimeError",
        message="Expected to mark a variable ready only once.",
        site="train.py:35  loss.backward()",
        step=step,
        explained=explained,
        phase="backward",
    )
    return RankState(rank=rank, world_size=2, outcome=Outcome.CRASHED, raised=raised, step=step, phase="backward")


def test_ranks_that_raise_the_same_ddp_error_get_one_finding_naming_both() -> None:
    findings = failure_findings({0: _crashed(0, ["head.bias"]), 1: _crashed(1, ["head.bias"])}, timed_out=False)
    assert [(f.code, f.ranks, f.steps) for f in findings] == [("used-outside-forward", [0, 1], [0])], findings
    f = findings[0]
    assert f.title == "ranks 0, 1: DDP failed at step 0", f.title
    assert f.detail.startswith("DDP failed on ranks 0, 1: with find_unused_parameters=True"), f.detail
    assert [p.name for p in f.params] == ["head.bias"]

    rec = recommend_after_failure(findings, {"find_unused_parameters": True}, where="rank 0 at step 0, backward")
    assert rec.flags_known and not rec.verified, rec
    assert (rec.find_unused_parameters, rec.static_graph, rec.gradient_as_bucket_view) == (False, True, False), rec
    assert "static_graph=True" in rec.reason, rec.reason


def test_ranks_that_fail_differently_keep_a_finding_each() -> None:
    states = {0: _crashed(0, ["head.bias"]), 1: _crashed(1, ["head.weight"])}
    findings = failure_findings(states, timed_out=False)
    assert [(f.code, f.ranks) for f in findings] == [("used-outside-forward", [0]), ("used-outside-forward", [1])]


def test_a_graph_that_changed_under_static_graph_calls_for_find_unused_parameters() -> None:
    states = {r: _crashed(r, ["aux.weight", "aux.bias"], code="static-graph-unsafe", step=2) for r in (0, 1)}
    findings = failure_findings(states, timed_out=False)
    assert [(f.code, f.ranks, f.steps) for f in findings] == [("static-graph-unsafe", [0, 1], [2])], findings
    rec = recommend_after_failure(findings, {"static_graph": True}, where="")
    assert (rec.find_unused_parameters, rec.static_graph) == (True, False), rec


def test_a_recommendation_without_flags_writes_nulls_never_the_scripts_flags() -> None:
    unknown = recommend_after_failure([], {"find_unused_parameters": True, "static_graph": True}, where="rank 0")
    data = unknown.to_dict()
    assert data["find_unused_parameters"] is None and data["static_graph"] is None, data
    assert data["gradient_as_bucket_view"] is None and data["verified"] is False and data["flags_known"] is False
    assert json.loads(json.dumps(data))["static_graph"] is None
    back = Recommendation.from_dict(data)
    assert not back.flags_known and back.ddp_kwargs == {} and back.reason == unknown.reason
    # A report written before the flags could be null carried the script's flags as placeholders: read as unknown.
    old = {**data, "find_unused_parameters": True, "static_graph": True, "gradient_as_bucket_view": False}
    assert Recommendation.from_dict(old).static_graph is None


def _held(rank: int, *, innermost: str | None, in_collective: bool = False) -> RankState:
    """A rank of a job that hangs past its observed steps (step 20, no phase), its main thread sampled at
    `innermost` (None: not sampled, as another node's record published before its sample)."""
    state = RankState(rank=rank, world_size=3, step=20, phase="", innermost=innermost)
    state.in_collective = in_collective
    return state


def test_the_rank_held_in_its_own_code_is_named_whatever_the_others_records_lack() -> None:
    """Every rank at the same step: the ranks whose sampled main thread is not in a collective are the ones the
    others wait for; a rank whose position was not sampled is named only when every sampled rank waits."""
    ddp_wait = "/torch/autograd/graph.py:_engine_run_backward"
    loop = "train.py:99 main"
    cases = [
        ({0: ddp_wait, 1: loop, 2: None}, [1]),  # rank 2 unsampled: not assumed to be held
        ({0: ddp_wait, 1: None, 2: ddp_wait}, [1]),  # the sampled ranks all wait: for the unsampled one
        ({0: loop, 1: ddp_wait, 2: ddp_wait}, [0]),
        ({0: None, 1: None, 2: ddp_wait}, [0, 1]),
        ({0: ddp_wait, 1: ddp_wait, 2: ddp_wait}, [0, 1, 2]),  # nothing tells: every rank
    ]
    for frames, stuck in cases:
        states = {r: _held(r, innermost=f) for r, f in frames.items()}
        (finding,) = failure_findings(states, timed_out=True)
        assert (finding.code, finding.ranks) == ("rank-hung", stuck), (frames, finding.ranks)
