"""`param-shapes-differ` from the ranks' own files (hand-built `RankState`s): DDP's constructor refused a model whose
parameter shapes differ by rank."""

from __future__ import annotations

from ddp_doctor.analyze.failures import failure_findings
from ddp_doctor.core.rankfiles import Outcome, RaisedError, WrapShapes
from ddp_doctor.core.rankstate import RankState

REFUSED = (
    "[1]: params[0] in this process with sizes [11, 16] appears not to match sizes of the same param in process 0."
)
LOST = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5004."


def _state(rank: int, message: str, wrap: WrapShapes | None) -> RankState:
    raised = RaisedError(type="RuntimeError", message=message, site="train.py:38", peer_lost=message == LOST)
    return RankState(rank=rank, world_size=2, outcome=Outcome.CRASHED, raised=raised, wrap=wrap)


def _wrap(rank: int, rows: int) -> WrapShapes:
    return WrapShapes(
        rank=rank,
        site="train.py:38",
        names=["embed.weight", "head.weight", "head.bias"],
        shapes=[[rows, 16], [2, 16], [2]],
    )


def test_each_differing_parameter_is_named_with_its_shape_on_each_rank() -> None:
    states = {0: _state(0, LOST, _wrap(0, 9)), 1: _state(1, REFUSED, _wrap(1, 11))}
    findings = failure_findings(states, timed_out=False)
    assert [f.code for f in findings] == ["param-shapes-differ"], findings
    f = findings[0]
    assert [(p.name, p.shape) for p in f.params] == [("embed.weight", (9, 16))]
    assert "embed.weight is [9, 16] on rank 0, [11, 16] on rank 1" in f.detail, f.detail
    assert "at train.py:38" in f.detail and "vocabulary" in f.detail and f.ranks == [0, 1]
    assert "broadcast" in f.fix


def test_without_wrap_records_the_error_itself_is_named() -> None:
    states = {0: _state(0, LOST, None), 1: _state(1, REFUSED, None)}
    f = failure_findings(states, timed_out=False)[0]
    assert f.code == "param-shapes-differ" and "params[0] is [11, 16] on rank 1" in f.detail, f.detail


COUNTED = "DDP expects same model across all ranks, but Rank 0 has 1 params, while rank 1 has inconsistent 3 params."


def test_parameters_trainable_on_some_ranks_only_are_named_with_their_ranks() -> None:
    frozen = WrapShapes(rank=0, site="train.py:38", names=["head.weight"], shapes=[[2, 16]])
    states = {0: _state(0, COUNTED, frozen), 1: _state(1, COUNTED.replace("Rank 0 has 1", "Rank 1 has 3"), _wrap(1, 9))}
    findings = failure_findings(states, timed_out=False)
    assert [f.code for f in findings] == ["param-shapes-differ"], findings
    f = findings[0]
    assert [(p.name, p.shape) for p in f.params] == [("embed.weight", (9, 16)), ("head.bias", (2,))]
    assert f.ranks == [0, 1] and f.severity == "error"
