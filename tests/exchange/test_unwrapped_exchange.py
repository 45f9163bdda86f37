"""The exchange of a run without a data-parallel wrapper (`model-not-wrapped`): every rank's side run at once by
`simulate.lockstep`, up to 1,024 ranks. What it must tell: which parameters differ on some rank, and that ranks
stepping different numbers of parameters cannot be paired; in bytes that do not grow with the world size."""

from __future__ import annotations

import pytest
import torch

from ddp_doctor.core.fingerprint import fingerprints_batched
from ddp_doctor.exchange.simulate import lockstep
from ddp_doctor.exchange.unwrapped import unwrapped_rounds


def _params(rank: int, odd: int, *, extra: bool = False) -> list[torch.Tensor]:
    """Three parameters alike on every rank but `odd`, whose second differs; `extra`: `odd` steps a fourth."""
    params = [torch.arange(12.0).reshape(3, 4), torch.ones(5), torch.zeros(2, 2)]
    if rank == odd:
        params[1] = params[1] + 0.5
        if extra:
            params.append(torch.ones(1))
    return params


def _run(world: int, odd: int, *, extra: bool = False):
    ranks = [_params(w, odd, extra=extra) for w in range(world)]
    return lockstep([unwrapped_rounds(len(p), 0, lambda p=p: fingerprints_batched(p)) for p in ranks])


@pytest.mark.parametrize("world", [2, 64, 1024])
def test_the_parameter_one_rank_holds_apart_is_named_in_bytes_that_do_not_grow(world: int) -> None:
    got, volume = _run(world, odd=world - 1)
    assert got.differ == [False, True, False] and got.gap == pytest.approx(2.5) and got.dtensors == 0, got
    _, at_two = _run(2, odd=1)
    assert (volume.sent, volume.collectives) == (at_two.sent, at_two.collectives) == (volume.sent, 2), volume


def test_ranks_that_step_different_numbers_of_parameters_are_not_paired() -> None:
    """Rank 700 of 1,024 steps a fourth parameter: nothing can be compared by position, every one differs, and the
    fingerprints are never sent (one round)."""
    got, volume = _run(1024, odd=700, extra=True)
    assert got.differ == [True, True, True] and got.gap == float("inf") and volume.collectives == 1, (got, volume)
