"""An EMA copy of a model with BatchNorm, wrapped in DDP too; rank 0 alone runs a forward through it to log the
EMA's loss every 4 steps. DDP's forward broadcasts the EMA's buffers from rank 0: on rank 0 alone, that broadcast
pairs with rank 1's next collective."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
model = DistributedDataParallel(net)
ema = DistributedDataParallel(copy.deepcopy(net))  # the EMA, wrapped too
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank)
for step in range(8):
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.99).add_(p, alpha=0.01)
        if rank == 0 and step % 4 == 0:
            ema(x)  # the EMA's loss, logged on rank 0 only
dist.destroy_process_group()
