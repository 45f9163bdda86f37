"""Rank 1 dies of SIGSEGV in native code before it builds DDP (a broken extension, say)."""

from __future__ import annotations

import ctypes
import os

import torch.distributed as dist
from _train import model
from torch.nn.parallel import DistributedDataParallel


def load_extension() -> None:
    if int(os.environ["RANK"]) == 1:
        ctypes.string_at(0)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    load_extension()
    DistributedDataParallel(model())
