"""The check's control rounds (`exchange/control.py`: whether following starts, whether some rank's sampler repeated
an epoch, whether some rank waits at a Join's end) run for every rank at once by the in-process model
(`simulate.lockstep`) up to 1,024 ranks, and over a real 4-rank gloo group: every rank reads the same answer, and
each rank sends the same 8 bytes whatever the world size and whichever ranks set their flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist import run_ranks

from ddp_doctor.exchange.control import ROUNDS, epoch_repeated, following_agreed, join_waits
from ddp_doctor.exchange.simulate import lockstep

CASES = [
    (2, set()),
    (2, {0, 1}),
    (64, {63}),
    (1024, set()),
    (1024, set(range(1024))),
    (1024, {517}),
    (1024, set(range(1024)) - {0}),
]
"""(world size, the ranks that set their flag)."""


@pytest.mark.parametrize(("world", "flagged"), CASES)
def test_every_control_round_gives_every_rank_the_same_answer_in_8_bytes(world: int, flagged: set[int]) -> None:
    expected = {
        "following_agreed": len(flagged) == world,  # every rank can start following, or none starts
        "epoch_repeated": bool(flagged),  # some rank saw a repeated epoch
        "join_waits": bool(flagged),  # some rank waits at the Join's end
    }
    for name, rounds in ROUNDS.items():
        answer, volume = lockstep([rounds(w in flagged) for w in range(world)])
        assert answer is expected[name], (name, world, sorted(flagged)[:4])
        assert (volume.collectives, volume.sent, volume.rounds) == (1, 8, ["max:8"]), (name, volume)


def _ranks(rank: int, world: int) -> list[bool]:
    from ddp_doctor.exchange.drive import drive

    return [
        drive(following_agreed(rank != 2), group=None, device=torch.device("cpu")),
        drive(following_agreed(True), group=None, device=torch.device("cpu")),
        drive(epoch_repeated(rank == 3), group=None, device=torch.device("cpu")),
        drive(epoch_repeated(False), group=None, device=torch.device("cpu")),
        drive(join_waits(rank == 0), group=None, device=torch.device("cpu")),
    ]


def test_the_control_rounds_over_a_real_group_of_4_answer_as_the_model_does(tmp_path: Path) -> None:
    answers = run_ranks(_ranks, tmp_path, world_size=4)
    assert answers == [[False, True, True, False, True]] * 4
