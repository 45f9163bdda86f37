"""guard()'s data checks: ranks with different batch counts, and a sampler epoch that does not advance."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist import run_ranks
from guardrun import capture, make_model, summary

from ddp_doctor import guard

# ------------------------------------------------------------------------------------------------- data checks


def _data_loop(rank: int, world: int, uneven: bool, set_epoch: bool) -> dict:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    ddp, opt = make_model()
    g = torch.Generator().manual_seed(rank)
    if uneven:  # hand-made shards: 10 samples on rank 0, 8 on rank 1, batch size 2
        data = TensorDataset(torch.randn(10 - 2 * rank, 8, generator=g), torch.randn(10 - 2 * rank, 4, generator=g))
        loader = DataLoader(data, batch_size=2)
    else:
        data = TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
        loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=True))
    lines = capture()
    with guard(ddp, every=3, optimizer=opt) as gd:
        for epoch in range(2):
            if set_epoch and not uneven:
                loader.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                if i == 4:
                    break  # the same number of steps on every rank: the check must come from the loader's length
                F.mse_loss(ddp(x, use_b=True), y).backward()
                opt.step()
                opt.zero_grad()
    return {"problems": summary(gd), "log": lines.text}


def test_guard_names_ranks_with_different_batch_counts(tmp_path) -> None:
    for rank, r in enumerate(run_ranks(_data_loop, tmp_path, args=(True, True))):
        uneven = [p for p in r["problems"] if p[0] == "uneven-inputs"]
        assert len(uneven) == 1 and uneven[0][1] == "error" and uneven[0][3] == [0, 1], r
        if rank == 0:  # the guard speaks on rank 0
            assert "batches per epoch" in r["log"] and r["log"].count("uneven-inputs") == 1, r["log"]


def test_guard_warns_once_when_the_sampler_epoch_does_not_advance(tmp_path) -> None:
    for r in run_ranks(_data_loop, tmp_path, args=(False, False)):
        assert [p[:2] for p in r["problems"]] == [("sampler-epoch-not-set", "warning")], r
    for r in run_ranks(_data_loop, tmp_path, args=(False, True)):
        assert r["problems"] == [], r
