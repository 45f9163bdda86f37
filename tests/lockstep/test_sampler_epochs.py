"""`sampler-epoch-not-set` on real gloo ranks: only a shuffling DistributedSampler whose loader starts a second pass
with the same epoch, named by the loader's creation line and the epochs seen; a non-shuffling evaluation sampler
iterated every epoch, and a loop that stays in its first epoch, say nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_doctor import observe
from ddp_doctor.observation import dataloaders


def _epochs(rank: int, world: int, set_epoch: bool, epochs: int, peek: bool = False) -> list[dict]:
    dataloaders.install()  # as the launcher does before the script: loaders get their creation line
    torch.manual_seed(0)
    train = TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    val = TensorDataset(torch.randn(8, 8), torch.randint(0, 2, (8,)))
    sampler = DistributedSampler(train, shuffle=True)
    train_loader = DataLoader(train, batch_size=4, sampler=sampler)  # line 24: named in the finding
    # The evaluation sampler shuffles (DistributedSampler's default, as torchvision's classification reference long
    # had it) and never gets set_epoch: no finding, since no optimizer step takes a batch from it.
    val_loader = DataLoader(val, batch_size=4, sampler=DistributedSampler(val))
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with observe(ddp, optimizer=opt, steps=2 * epochs) as doctor:
        for epoch in range(epochs):
            if peek:  # PyTorch's DDP tutorial reads the batch size this way, before set_epoch
                len(next(iter(train_loader))[0])
            if set_epoch:
                sampler.set_epoch(epoch)
            for x, y in train_loader:
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
            with torch.no_grad():  # evaluation through the inner module: its sampler never shuffles
                for x, _ in val_loader:
                    ddp.module(x)
    return [f.to_dict() for f in doctor.report().findings]


def _sampler(findings: list[dict]) -> list[dict]:
    return [f for f in findings if f["code"] == "sampler-epoch-not-set"]


def test_a_shuffling_sampler_without_set_epoch_is_named_by_its_loader_and_epochs(tmp_path) -> None:
    for findings in run_ranks(_epochs, tmp_path, args=(False, 3)):
        found = _sampler(findings)
        assert len(found) == 1, findings  # the training loader only, never the evaluation one
        f = found[0]
        assert f["severity"] == "warning" and f["ranks"] == [0, 1], f
        assert "created at tests/lockstep/test_sampler_epochs.py:24" in f["title"], f
        assert "started 3 passes with the sampler's epoch at [0, 0, 0]" in f["detail"], f


def test_set_epoch_or_a_single_epoch_leaves_only_the_evaluation_sampler_silent_too(tmp_path) -> None:
    for findings in run_ranks(_epochs, tmp_path, args=(True, 3)):
        assert _sampler(findings) == [], findings
    for findings in run_ranks(_epochs, tmp_path, args=(False, 1)):
        assert _sampler(findings) == [], findings


def test_a_one_batch_peek_before_set_epoch_is_no_epoch(tmp_path) -> None:
    """PyTorch's DDP tutorial (multigpu_torchrun.py) takes `next(iter(loader))` for the batch size before
    `set_epoch`: that pass yields one batch of several and is dropped, so it is no epoch of its own."""
    for findings in run_ranks(_epochs, tmp_path, args=(True, 3, True)):
        assert _sampler(findings) == [], findings
    for findings in run_ranks(_epochs, tmp_path, args=(False, 3, True)):
        (f,) = _sampler(findings)
        assert "started 3 passes with the sampler's epoch at [0, 0, 0]" in f["detail"], f
