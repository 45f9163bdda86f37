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
        info = dataloaders.describe(DataLoader(data, batch_sampler=shard))
        assert info["sampler"] == type(sampler).__name__
        # The batches are sharded over the ranks: no rank reads the whole dataset (no `shards-overlap`).
        assert "dataset_digest" not in info


def test_a_dataset_is_digested_only_when_what_it_holds_is_known() -> None:
    from torch.utils.data import Dataset, Subset

    from ddp_doctor.observation.datasets import dataset_digest

    x = torch.arange(12.0).reshape(6, 2)
    same, other = TensorDataset(x.clone(), torch.arange(6)), TensorDataset(x + 1, torch.arange(6))
    assert dataset_digest(TensorDataset(x, torch.arange(6))) == dataset_digest(same) != dataset_digest(other)
    assert dataset_digest(Subset(same, [0, 2])) != dataset_digest(Subset(same, [1, 3])) is not None
    assert dataset_digest(TensorDataset(torch.zeros(2, dtype=torch.bfloat16))) is not None  # any dtype's bytes

    class Files(Dataset):
        def __init__(self, root: str) -> None:
            self.root = root

        def __len__(self) -> int:
            return 3

    assert dataset_digest(Files("/data/a")) != dataset_digest(Files("/data/b"))

    class Unknown(Dataset):
        def __len__(self) -> int:
            return 3

    assert dataset_digest(Unknown()) is None
    assert dataset_digest(TensorDataset(torch.zeros(2, device="meta"))) is None  # not on the CPU: not read
    # A loader ordering its whole dataset carries the digest; a DistributedSampler's does not need it.
    assert dataloaders.describe(DataLoader(same, shuffle=True))["dataset_digest"] == dataset_digest(same)
    assert "dataset_digest" not in dataloaders.describe(DataLoader(same, sampler=DistributedSampler(same, 2, 0)))
