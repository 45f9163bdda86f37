"""Where the ranks' collective sequences part on a failed run: from each rank's last collectives in its beacon
(`RankState.recent`), DDP's buffer broadcasts among them, hand-built and through `check`."""

from __future__ import annotations

from pathlib import Path

from checkrun import SCRIPTS, check, line_of

from ddp_doctor.analyze.collective_order import beacons_apart
from ddp_doctor.analyze.parting import beacons_parting
from ddp_doctor.core.beacon import Collective
from ddp_doctor.core.rankstate import RankState

MODEL, EMA = "3 buffers of the DDP model built at train.py:10", "3 buffers of the DDP model built at train.py:11"


def _broadcast(n: int, tensor: str, site: str) -> Collective:
    return Collective(op="broadcast", n=n, site=site, tensor=tensor, step=n // 2, ddp_buffers=True)


def _waiting(rank: int, recent: list[Collective]) -> RankState:
    return RankState(
        rank=rank,
        world_size=2,
        outcome=None,
        ddp_models=1,
        step=2,
        phase="backward",
        collective=recent[-1],
        collectives=recent[-1].n,
        in_collective=True,
        recent=recent,
    )


def test_sequences_that_paired_different_broadcasts_part_at_the_first_of_them() -> None:
    """Rank 0 ran a forward through a second DDP model (its EMA) that rank 1 never ran: the two broadcasts paired
    at position 2 (same sizes, silently), and the ranks went on, one collective apart."""
    rank0 = [
        _broadcast(1, MODEL, "train.py:20"),
        _broadcast(2, EMA, "train.py:25"),
        _broadcast(3, MODEL, "train.py:20"),
    ]
    rank1 = [
        _broadcast(1, MODEL, "train.py:20"),
        _broadcast(2, MODEL, "train.py:20"),
        _broadcast(3, MODEL, "train.py:20"),
    ]
    states = {0: _waiting(0, rank0), 1: _waiting(1, rank1)}
    parting = beacons_parting(states)
    assert parting is not None and parting.earlier
    assert (parting.first.rank, parting.first.collective.n, parting.first.collective.tensor) == (0, 2, EMA)
    assert [(s.rank, s.collective.tensor) for s in parting.different] == [(1, MODEL)]
    f = beacons_apart(states, parting)
    assert f.code == "collective-mismatch" and f.ranks == [0, 1] and f.sites == ["train.py:25", "train.py:20"], f


def test_sequences_that_agree_up_to_the_last_collective_part_there() -> None:
    """The same broadcasts everywhere, then rank 0 alone in a barrier: the last collective decides."""
    shared = [_broadcast(1, MODEL, "train.py:20"), _broadcast(2, MODEL, "train.py:20")]
    barrier = Collective(op="barrier", n=3, site="train.py:30", step=1)
    states = {0: _waiting(0, [*shared, barrier]), 1: _waiting(1, shared)}
    states[1].in_collective = False
    parting = beacons_parting(states)
    assert parting is not None and not parting.earlier
    assert parting.first.rank == 0 and [s.rank for s in parting.behind] == [1]


def test_a_broadcast_rank_0_sent_and_left_is_the_parting_when_a_peer_aborts() -> None:
    """The race in the script below: rank 0, the root, sent the EMA's buffers and returned at once, and was inside
    the next forward's rebuild of the gradient buckets (a collective the beacon does not record) when rank 1 aborted
    on the size. No rank is in a recorded collective; the broadcast rank 0 left unmatched is still the parting."""
    rank0 = [_broadcast(1, MODEL, "train.py:20"), _broadcast(2, EMA, "train.py:25")]
    rank1 = [_broadcast(1, MODEL, "train.py:20")]
    states = {0: _waiting(0, rank0), 1: _waiting(1, rank1)}
    for s in states.values():
        s.in_collective = False
    parting = beacons_parting(states)
    assert parting is None  # no rank aborted: nothing says the sequences parted
    states[1].signal = "SIGABRT"
    parting = beacons_parting(states)
    assert parting is not None and (parting.first.rank, parting.first.collective.tensor) == (0, EMA)
    assert [s.rank for s in parting.behind] == [1] and parting.sent


def test_a_forward_through_a_second_ddp_model_on_rank_0_alone_leads_the_report(tmp_path: Path) -> None:
    """Ground truth under plain torchrun (tests/scripts/second_ddp_rank0.py): rank 0's EMA forward broadcasts the
    EMA's buffers, which rank 1's next forward meets; rank 1 aborts ("512 vs 28. Received data size doesn't match",
    exit -6) and rank 0 fails with "Connection reset by peer"; torchrun names rank 1 as the root cause. Before, the
    report led with rank 1's SIGABRT."""
    script = SCRIPTS / "second_ddp_rank0.py"
    run = check(["--nproc-per-node", "2", str(script)], tmp_path)
    f = run.finding("collective-mismatch")
    assert f["caused_by"] == [] and f["ranks"] == [0, 1], f
    assert f"tests/scripts/second_ddp_rank0.py:{line_of(script, '# the EMA' + chr(39) + 's loss')}" in f["sites"], f
    assert run.finding("rank-crashed")["caused_by"] == ["collective-mismatch"]
