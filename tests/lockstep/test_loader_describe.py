"""How a DataLoader is described to the observers (`observation.dataloaders.describe`): by the sampler that orders
its samples, also when a batch sampler holds it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from ddp_doctor.observation import dataloaders


def test_a_loader_given_a_batch_sampler_is_described_by_the_sampler_inside_it() -> None:
    # DataLoader.sampler is then a placeholder SequentialSampler; the one inside the batch sampler orders the samples.
    data = TensorDataset(torch.randn(10, 2))
    inner = DistributedSampler(data, num_replicas=4, rank=0, shuffle=True)
    info = dataloaders.describe(DataLoader(data, batch_sampler=BatchSampler(inner, 2, drop_last=False)))
    assert (info["sampler"], info["shuffle"], info["padded"], info["dataset"]) == ("DistributedSampler", True, 2, 10)


def test_a_loader_prepared_by_accelerate_is_described_by_the_users_sampler() -> None:
    # prepare() wraps the original BatchSampler in a BatchSamplerShard: a shuffling loader and an evaluation loader
    # would otherwise both read SequentialSampler.
    data_loader = pytest.importorskip("accelerate.data_loader")
    data = TensorDataset(torch.randn(16, 2))
    for sampler in (RandomSampler(data), SequentialSampler(data)):
        shard = data_loader.BatchSamplerShard(BatchSampler(sampler, 4, drop_last=False), num_processes=2)
        assert dataloaders.describe(DataLoader(data, batch_sampler=shard))["sampler"] == type(sampler).__name__
