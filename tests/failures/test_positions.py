"""Where each rank was when a failed run ended is evidence of its findings (`Finding.positions`, the JSON's
`positions`): its step, phase and line, how it was known, the collective it sat in. Hand-built `RankState`s, as
the supervisor merges them from the ranks' files; the runs that produce them are in the other tests here."""

from __future__ import annotations

import json

import pytest

from ddp_doctor.analyze.failures import failure_findings
from ddp_doctor.analyze.positions import position, where
from ddp_doctor.core.beacon import Collective
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.rankfiles import Outcome, RaisedError
from ddp_doctor.core.rankstate import RankState
from ddp_doctor.core.whereabouts import Position, said


def _waiting(rank: int, world: int = 4) -> RankState:
    """A rank inside the script's all_reduce at train.py:50, step 3."""
    s = RankState(rank=rank, world_size=world, step=3, phase="after backward")
    s.in_collective = True
    s.collective = Collective(op="all_reduce", n=7, site="train.py:50", tensor="float32[4]")
    return s


def _held(rank: int, world: int = 4) -> RankState:
    """A rank sampled at its own line train.py:61 (a sleep, a DataLoader's next()) for 12.5 s, step 2."""
    return RankState(
        rank=rank, world_size=world, step=2, phase="forward", user_frame="train.py:61 (in main)", sample_age_s=12.5
    )


def test_a_hang_records_where_every_waiting_rank_was() -> None:
    """Rank 2 is held in its own code one step behind; ranks 0, 1 and 3 wait in an all_reduce for it."""
    states = {r: _held(r) if r == 2 else _waiting(r) for r in range(4)}
    (hung,) = failure_findings(states, timed_out=True)
    assert (hung.code, hung.ranks, hung.steps) == ("rank-hung", [2], [2])
    by_rank = {p.rank: p for p in hung.positions}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert by_rank[2] == Position(
        rank=2, step=2, phase="forward", how="sampled", site="train.py:61 (in main)", age_s=12.5
    )
    for r in (0, 1, 3):
        assert (by_rank[r].how, by_rank[r].step, by_rank[r].site) == ("in-collective", 3, "train.py:50")
        assert by_rank[r].collective == "all_reduce(float32[4])"


def test_the_positions_name_the_first_ranks_only_at_scale() -> None:
    """At 64 ranks the finding keeps the positions its words describe (8), not one per rank."""
    states = {r: _held(r, 64) if r == 5 else _waiting(r, 64) for r in range(64)}
    (hung,) = failure_findings(states, timed_out=True)
    assert hung.ranks == [5]
    assert [p.rank for p in hung.positions] == list(range(8))


def test_a_crash_records_the_raising_rank_first_then_the_others() -> None:
    """Rank 1 raised its own error at train.py:33 in step 4; rank 0 still waited in the all_reduce."""
    raised = RaisedError(type="ValueError", message="bad batch", site="train.py:33", step=4, phase="forward")
    states = {0: _waiting(0, 2), 1: RankState(rank=1, world_size=2, outcome=Outcome.CRASHED, raised=raised, step=4)}
    crashed = next(f for f in failure_findings(states, timed_out=False) if f.code == "rank-crashed")
    assert crashed.ranks == [1]
    assert [(p.rank, p.how, p.step, p.site) for p in crashed.positions] == [
        (1, "raised", 4, "train.py:33"),
        (0, "in-collective", 3, "train.py:50"),
    ]


def test_positions_survive_the_json_and_are_left_out_where_there_are_none() -> None:
    states = {r: _held(r) if r == 2 else _waiting(r) for r in range(4)}
    (hung,) = failure_findings(states, timed_out=True)
    data = json.loads(json.dumps(hung.to_dict()))
    assert data["positions"][2] == {
        "rank": 2,
        "step": 2,
        "phase": "forward",
        "how": "sampled",
        "site": "train.py:61 (in main)",
        "collective": None,
        "waiting": None,
        "age_s": 12.5,
        "lost_peer": False,
    }
    assert Finding.from_dict(data).positions == hung.positions
    assert "positions" not in Finding(code="rank-hung", severity="error", title="t").to_dict()


@pytest.mark.parametrize(
    ("state", "how", "waiting"),
    [
        (RankState(rank=0, step=1, phase="backward", site="train.py:20"), "after", "ddp-backward"),
        (
            RankState(rank=0, step=1, phase="", innermost="/torch/autograd/graph.py:_engine_run_backward"),
            "innermost",
            "autograd",
        ),
        (RankState(rank=0, step=1, phase="forward"), "innermost", None),
    ],
)
def test_how_a_position_was_known_and_where_backward_waits(state: RankState, how: str, waiting: str | None) -> None:
    p = position(0, state)
    assert (p.how, p.waiting, p.step) == (how, waiting, 1)
    assert where(state) == said(p)


def test_a_position_of_an_unknown_kind_is_refused() -> None:
    with pytest.raises(AssertionError, match="unknown position kind 'guessed'"):
        Position(rank=0, step=0, phase="forward", how="guessed")


def test_a_killed_rank_carries_its_own_position_then_the_others_and_counts_them() -> None:
    """At 64 ranks rank 5 died of SIGKILL; rank 0 raised its lost connection, the other 62 still waited: the
    finding carries rank 5's position, then the first 8 others' (rank 0's marked as a lost peer), and counts 63."""
    lost = RaisedError(
        type="RuntimeError", message="Connection closed by peer", site="train.py:50", step=3, peer_lost=True
    )
    states = {r: _waiting(r, 64) for r in range(64)}
    states[0] = RankState(rank=0, world_size=64, outcome=Outcome.CRASHED, raised=lost, step=3)
    states[5] = RankState(rank=5, world_size=64, step=3, phase="forward", signal="SIGKILL", site="train.py:30")
    killed = next(f for f in failure_findings(states, timed_out=False) if f.labels.get("signal") == "SIGKILL")
    assert killed.ranks == [5] and killed.labels["kind"] == "signal"
    assert [p.rank for p in killed.positions] == [5, 0, 1, 2, 3, 4, 6, 7, 8]
    assert killed.positions[1].lost_peer and not killed.positions[2].lost_peer
    assert {m.name: m.value for m in killed.measured}["other_ranks"] == 63
