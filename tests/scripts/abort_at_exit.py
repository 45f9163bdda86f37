"""A DDP script that trains to its end, writes its result, then dies at interpreter exit the way torch 2.13's gloo
sometimes does: std::terminate with no active exception ("terminate called without an active exception", SIGABRT),
called from an atexit hook after the script's last line. With --raise it fails before its end instead.

    torchrun --nproc-per-node 2 tests/scripts/abort_at_exit.py OUT [--raise]
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _terminate() -> None:
    sys.stdout.flush()
    ctypes.CDLL("libstdc++.so.6")._ZSt9terminatev()  # std::terminate(): the native abort, its own message


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    if "--raise" in sys.argv:
        raise RuntimeError("failed before the end")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.done"), "w") as f:
        f.write("trained 3 steps")
    if rank == 1:
        atexit.register(_terminate)
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
