"""A DDP job of STEPS steps (default 400) of an MLP (70 blocks of width 128, 280 parameter tensors), with each rank
writing to STEP_TIMES_DIR/rank{R}.json the wall time of every step after the first FROM (default 100): the steady
steps that `ddp-doctor watch` only watches.

    torchrun --nproc-per-node 2 benchmarks/scripts/steady_steps.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps, first = int(os.environ.get("STEPS", "400")), int(os.environ.get("FROM", "100"))
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(70):
        layers += [nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU()]
    model = DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 128)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= first:
            times.append(time.perf_counter() - start)
    Path(os.environ["STEP_TIMES_DIR"], f"rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
