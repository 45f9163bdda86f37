"""A DDP model of the scenario `Net` and the steps the in-process tests of observe() and refreeze() train it with:
one synthetic batch per rank and step (`scenarios.batch`), an MSE loss, and a comm hook that counts the bytes DDP
sends."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from scenarios import Net, batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def sgd_model(**kwargs) -> tuple[DDP, torch.optim.Optimizer]:
    """`Net` seeded alike on every rank, in DDP built with `kwargs`, and an SGD optimizer over it."""
    torch.manual_seed(0)
    ddp = DDP(Net(), **kwargs)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)


def train_step(ddp: DDP, opt: torch.optim.Optimizer | None, rank: int, step: int, *, use_b: bool = True) -> None:
    """One training step on this rank's batch of `step` (head_b reaches the loss only with `use_b`); without `opt`,
    the backward only."""
    x, y = batch(rank, step)
    F.mse_loss(ddp(x, use_b=use_b), y).backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()


def counting_hook(state, bucket):  # no annotations: DDP checks the annotation objects, which strings are not
    """All-reduce like DDP's default, and record the bytes of every bucket."""
    buf = bucket.buffer()
    state.append(buf.numel() * buf.element_size())
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def nbytes(module: nn.Module, names: list[str] | None = None) -> int:
    """The bytes of `module`'s parameters (of those in `names`, when given)."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if (names is None or n in names))
