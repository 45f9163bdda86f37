"""Steady-state cost of guard(): guarded DDP steps against unguarded DDP steps.

Run under torchrun (``python -m benchmarks`` does that). Three identical DDP models train side by side in one
process per rank (plain, guard(every=100), guard(every=10)); every round times one step of each, in rotating
order. Reports the median per-round ratio with its interquartile range, and the ratio of total times, which
includes the periodic replica comparison the median leaves out.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import interleave, mlp, parser, ratio, write
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import guard


def main() -> None:
    args = parser(rounds=300).parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))
    models = {}
    guards = []
    for name, every in (("plain", None), ("every=100", 100), ("every=10", 10)):
        ddp = DDP(mlp(args.depth, args.width))
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        if every is not None:
            guards.append(guard(ddp, every=every, optimizer=opt))
        models[name] = (ddp, opt)

    def step(ddp: DDP, opt: torch.optim.Optimizer) -> None:
        F.mse_loss(ddp(x), x).backward()
        opt.step()
        opt.zero_grad()

    variants = {name: (lambda m=m: step(*m)) for name, m in models.items()}
    for fn in variants.values():  # warm-up, and the first healthy step that disarms the first-step hooks
        fn()
        fn()
    times = interleave(variants, args.rounds)
    result = {
        "param_tensors": sum(1 for _ in models["plain"][0].parameters()),
        "rounds": args.rounds,
        "plain_step_ms": round(sorted(times["plain"])[len(times["plain"]) // 2] * 1e3, 2),
        "guard every=100": ratio(times["every=100"], times["plain"], vs="unguarded DDP step", goal="<= 1.01x"),
        "guard every=10": ratio(times["every=10"], times["plain"], vs="unguarded DDP step", goal="<= 1.01x"),
        "problems": [f.code for g in guards for f in g.problems],
        "checks": [g.checks for g in guards],
    }
    for g in guards:
        g.close()
    write(result, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
