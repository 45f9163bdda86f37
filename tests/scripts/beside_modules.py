"""Distillation: a DDP student trained toward a frozen teacher the script calls beside it, outside DDP. Each rank
writes OUT/rank{RANK}.json: its teacher's parameters' sum (`teacher`) and its student's at the end (`student`).

    torchrun --nproc-per-node 2 tests/scripts/beside_modules.py OUT --case CASE

cases:
  same         the teacher built from the same seed on every rank
  rank-seed    the teacher built after torch.manual_seed(rank): each rank's own
  rank0-load   the same teacher everywhere, then a checkpoint loaded into it on rank 0 only
  broadcast    rank-seed, then rank 0's teacher broadcast to every rank before training (the fix)
  ema          the same teacher, and an EMA of the student (torch.optim.swa_utils.AveragedModel) updated and
               evaluated after each step
  rank-seed-slot   rank-seed, and a parameter attached to the student after DDP was built (`student.module[0].slot`,
               all ones on every rank, used by no forward yet). Each rank also writes `slot`, that parameter's sum
  rank-seed-slot-apart   the same, the parameter filled with rank + 1 (it differs across ranks)
  rank-seed-eval   rank-seed, and rank 0 alone puts the student in eval mode from step 4 on
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--case", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    student = DistributedDataParallel(net())
    slot = args.case.startswith("rank-seed-slot")
    if slot:
        student.module[0].slot = nn.Parameter(torch.full((3,), rank + 1.0 if args.case.endswith("apart") else 1.0))
    torch.manual_seed(rank + 1 if args.case in ("rank-seed", "broadcast", "rank-seed-eval") or slot else 1)
    teacher = net().eval().requires_grad_(False)
    if args.case == "rank0-load" and rank == 0:
        teacher.load_state_dict({k: v * 1.5 for k, v in teacher.state_dict().items()})
    if args.case == "broadcast":
        for t in [*teacher.parameters(), *teacher.buffers()]:
            dist.broadcast(t.data, src=0)
    ema = torch.optim.swa_utils.AveragedModel(student.module) if args.case == "ema" else None
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    for step in range(10):
        if args.case == "rank-seed-eval" and rank == 0 and step == 4:
            student.eval()
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
        with torch.no_grad():
            target = teacher(x)
        loss = (student(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ema is not None:
            ema.update_parameters(student.module)
            with torch.no_grad():
                ema(x)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "teacher": float(sum(p.sum() for p in teacher.parameters())),
                "student": float(sum(p.detach().sum() for p in student.parameters())),
                "slot": float(student.module[0].slot.detach().sum()) if slot else None,
            },
            f,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
