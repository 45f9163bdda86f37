"""A model built from rank-local data: each rank sizes its embedding by the vocabulary of its own text shard, so
rank 1's table has one row more than rank 0's and DDP's constructor refuses the model ("params[0] in this process
with sizes [9, 16] appears not to match sizes of the same param in process 0"). With --broadcast-vocab, rank 0's
vocabulary is broadcast first and every rank builds the same model."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

SHARDS = ["the cat sat on the mat", "the dog sat on the big red mat"]


class Tagger(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    vocab = sorted(set(SHARDS[rank % len(SHARDS)].split()))
    if "--broadcast-vocab" in sys.argv:
        shared = [vocab]
        dist.broadcast_object_list(shared, src=0)
        vocab = shared[0]
    torch.manual_seed(0)
    model = DistributedDataParallel(Tagger(len(vocab) + 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _step in range(10):
        ids, y = torch.randint(0, len(vocab), (4, 5), generator=g), torch.randint(0, 2, (4,), generator=g)
        F.cross_entropy(model(ids), y).backward()
        opt.step()
        opt.zero_grad()
