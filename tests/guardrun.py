"""What the guard tests share: a guarded model and its step, and the guard's log lines captured."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from scenarios import Net, batch
from torch.nn.parallel import DistributedDataParallel as DDP


class Lines(logging.Handler):
    """The guard's log records, kept."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


def capture() -> Lines:
    handler = Lines()
    log = logging.getLogger("ddp_doctor.guard")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


def make_model(**kwargs) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    ddp = DDP(Net(batchnorm=kwargs.pop("batchnorm", False)), **kwargs)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)


def train_step(ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    F.mse_loss(ddp(x, use_b=True), y).backward()
    opt.step()
    opt.zero_grad()


def summary(g) -> list[tuple]:
    return [(f.code, f.severity, f.param_names, f.ranks, f.steps) for f in g.problems]
