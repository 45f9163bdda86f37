"""A GAN: generator and critic, each its own DDP model and optimizer. The critic has an auxiliary head that never
reaches its loss, so with default flags the critic's DDP fails at step 1; the generator is healthy."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU())
        self.score = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 3)     # meant for a classification loss the script never added

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.body(x))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    generator = DistributedDataParallel(nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4)))
    critic = DistributedDataParallel(Critic())
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _step in range(20):
        real = torch.randn(8, 4, generator=g)
        fake = generator(torch.randn(8, 2, generator=g))
        loss_c = critic(fake.detach()).mean() - critic(real).mean()
        opt_c.zero_grad()
        loss_c.backward()
        opt_c.step()
        loss_g = -critic(generator(torch.randn(8, 2, generator=g))).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
