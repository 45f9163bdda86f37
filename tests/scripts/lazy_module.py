"""A model with a lazy layer (`nn.LazyLinear`) wrapped in DDP before any forward initialised it. Plain torchrun: both
ranks fail in DDP's constructor, *Modules with uninitialized parameters can't be used with DistributedDataParallel.
Run a dummy forward pass to correctly initialize the modules*, exit code 1."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        loss = model(torch.randn(8, 16)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
