"""An Accelerate loop (find_unused_parameters=True through DistributedDataParallelKwargs, a scheduler), long enough
for `ddp-doctor bench` to run every candidate in one launch: the DDP object Accelerate holds is rebuilt in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch import nn

if __name__ == "__main__":
    acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    model, opt, sched = acc.prepare(model, opt, sched)
    g = torch.Generator().manual_seed(acc.process_index)
    for _ in range(300):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
