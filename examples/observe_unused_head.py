"""A multi-task model that trains only one of its two heads (parameters that never reach the loss), observed by ddp-doctor.

Run it like any DDP script:

    torchrun --standalone --nproc-per-node 2 examples/observe_unused_head.py            # default DDP flags
    torchrun --standalone --nproc-per-node 2 examples/observe_unused_head.py --find-unused

With default flags DDP silently skips the gradient all-reduce on step 0 and fails on step 1; the doctor explains the
failure, names the head, and recommends the cheapest correct fix. Uses NCCL and the GPU of LOCAL_RANK when CUDA is
available, else gloo on CPU.
"""

from __future__ import annotations

import argparse

import rich
import torch
import torch.nn.functional as F
from common import device_ids, setup, teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor import DDPFailure, observe


class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        self.classify = nn.Linear(64, 10)
        self.regress = nn.Linear(64, 1)  # the task this run does not train

    def forward(self, x: torch.Tensor, task: str = "classify") -> torch.Tensor:
        h = self.encoder(x)
        return self.classify(h) if task == "classify" else self.regress(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--find-unused", action="store_true", help="build DDP with find_unused_parameters=True")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    rank, device = setup()
    torch.manual_seed(0)
    model = MultiTask().to(device)
    ddp = DistributedDataParallel(model, device_ids=device_ids(device), find_unused_parameters=args.find_unused)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(rank)  # each rank its own shard

    doctor = observe(ddp, optimizer=opt)
    try:
        with doctor:
            for _ in range(args.steps):
                x = torch.randn(16, 32, generator=data).to(device)
                y = torch.randint(0, 10, (16,), generator=data).to(device)
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    except DDPFailure as exc:
        if rank == 0:
            print(f"The training loop failed, and ddp-doctor explains why:\n  {exc}\n")
    report = doctor.report()  # collective: every rank calls it
    if rank == 0:
        rich.print(report)
    del ddp, model, opt, doctor   # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
