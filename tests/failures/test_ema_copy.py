"""An EMA made by copying the DDP model itself, evaluated on rank 0 alone (tests/scripts/ema_copy.py).

Ground truth under plain torchrun (torch 2.13, gloo, 2 ranks, the group's timeout 15 s): with
`AveragedModel(model)` or `copy.deepcopy(model)` and `--eval rank0`, the job hangs at the first evaluation and the
timeout ends it (exit 1, about 25 s: rank 0 in its next training forward's buffer broadcast, rank 1 in its gradient
all-reduce). The copy is a DDP model of its own: its forward broadcast the EMA's buffers from rank 0, and rank 1's
next training forward took them as its own model's broadcast (same sizes), so the ranks went on one collective apart.
With `AveragedModel(model.module)`, or the evaluation on every rank: exit 0.

Before, the report named rank 0's *training* forward as the collective rank 1 "never called", with the fix "run the
forward at <the training line> on every rank", which the script already does; or, when gloo's timeout reached rank
0 as "Application timeout caused pair closure", a crash of rank 0 alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check, line_of

from ddp_doctor.analyze.parting import beacons_parting
from ddp_doctor.core.beacon import Collective
from ddp_doctor.core.rankstate import RankState

pytestmark = pytest.mark.timeout(300)

SCRIPT = SCRIPTS / "ema_copy.py"
MODEL = "3 buffers of the DDP model built at train.py:10"
COPY = "3 buffers of a copy (made at train.py:11) of the DDP model built at train.py:10"


def _rank(rank: int, recent: list[Collective], *, waiting: bool) -> RankState:
    return RankState(
        rank=rank,
        world_size=2,
        ddp_models=1,
        step=4,
        phase="forward" if waiting else "backward",
        collective=recent[-1],
        collectives=recent[-1].n,
        in_collective=waiting,
        recent=recent,
    )


def test_a_copys_broadcast_paired_with_a_peers_last_collective_is_where_the_ranks_part() -> None:
    """Rank 1's last recorded collective (its training forward's broadcast, #2) was taken by rank 0's copy's
    broadcast; rank 1 left it for its gradient all-reduce (not recorded), rank 0 waits in #3."""

    def broadcast(n: int, tensor: str, site: str, copied: str | None = None) -> Collective:
        return Collective(op="broadcast", n=n, site=site, tensor=tensor, ddp_buffers=True, copied_at=copied)

    rank0 = [broadcast(1, MODEL, "train.py:20"), broadcast(2, COPY, "train.py:30", "train.py:11")]
    rank0.append(broadcast(3, MODEL, "train.py:20"))
    rank1 = [broadcast(1, MODEL, "train.py:20"), broadcast(2, MODEL, "train.py:20")]
    parting = beacons_parting({0: _rank(0, rank0, waiting=True), 1: _rank(1, rank1, waiting=False)})
    assert parting is not None and parting.earlier
    assert (parting.first.rank, parting.first.collective.n, parting.first.collective.copied_at) == (0, 2, "train.py:11")
    assert [(s.rank, s.collective.tensor) for s in parting.different] == [(1, MODEL)]


@pytest.mark.parametrize("copy", ["averaged", "deepcopy"])
def test_an_ema_copy_of_the_ddp_model_evaluated_on_rank_0_alone_is_named_at_its_forward(tmp_path, copy) -> None:
    """`AveragedModel(model)` and `copy.deepcopy(model)`: both copy through DDP's `__setstate__`."""
    run = check(["--nproc-per-node", "2", str(SCRIPT), "--copy", copy], tmp_path)
    assert run.rc == 1, run.output
    f = run.report["findings"][0]
    assert f["code"] == "collective-mismatch" and f["ranks"] == [0, 1], run.output
    evaluated = f"tests/scripts/ema_copy.py:{line_of(SCRIPT, 'out = ema(probe)')}"
    trained = f"tests/scripts/ema_copy.py:{line_of(SCRIPT, 'loss = F.cross_entropy(model(x), y)')}"
    assert f["sites"] == [evaluated, trained], f
    assert "rank-crashed" not in run.codes, run.output


def test_an_ema_of_the_inner_module_evaluated_on_rank_0_alone_is_clean(tmp_path: Path) -> None:
    """Only the info every small BatchNorm batch gets. (The first Linear's bias, followed by the BatchNorm, gets a
    gradient of round-off only, about 1e-8, and never moves under SGD: no `training-stalled` either.)"""
    run = check(["--nproc-per-node", "2", str(SCRIPT), "--copy", "inner"], tmp_path)
    assert run.rc == 0 and run.codes == {"batchnorm-not-synced"}, run.output
    assert run.report["compared"]["modules_beside"] == 0  # rank 1 never runs the EMA: not compared
