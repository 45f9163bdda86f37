"""The sharded report's naming of ranks whose copy differs (`exchange/sharded_protocol.held_apart`), on real gloo
groups of 4 ranks: the most common copy is the reference (the lowest rank on a tie), the others are named, and what
the reference rank and the first other rank hold reaches every rank."""

from __future__ import annotations

from pathlib import Path

from dist import run_ranks


def _apart(rank: int, world: int, digests: list[int]) -> dict:
    import torch

    from ddp_doctor.exchange.drive import drive
    from ddp_doctor.exchange.sharded_protocol import held_apart

    steps = held_apart(float(digests[rank]), f"copy {digests[rank]} of rank {rank}", rank=rank, world=world)
    return drive(steps, group=None, device=torch.device("cpu"))


def test_the_most_common_copy_is_the_reference_and_the_others_are_named(tmp_path: Path) -> None:
    for digests, reference, ranks in (
        ([7, 7, 9, 7], 0, [2]),  # one rank apart
        ([5, 7, 7, 7], 1, [0]),  # rank 0 is the odd one: the reference is the most common copy
        ([7, 9, 7, 9], 0, [1, 3]),  # a tie: the lowest rank's copy
    ):
        results = run_ranks(_apart, tmp_path, world_size=4, args=(digests,), timeout=120)
        assert all(r == results[0] for r in results), results
        first = ranks[0]
        assert results[0] == {
            "reference": reference,
            "ranks": ranks,
            "more": 0,
            "held": {
                reference: f"copy {digests[reference]} of rank {reference}",
                first: f"copy {digests[first]} of rank {first}",
            },
        }, digests
