"""A GAN whose generator and discriminator live in one module under one DDP wrapper, with both losses computed from
ONE forward and two backward passes through it: `d_loss.backward(retain_graph=True)`, then `g_loss.backward()`.

Usage: torchrun --nproc-per-node 2 gan_two_passes.py [--inputs] [--separate]
  (default)    the generator loss's backward reaches the discriminator too (both passes reach it)
  --inputs     `g_loss.backward(inputs=generator params)`: each parameter gets its gradient in exactly one pass
  --separate   each loss's backward follows a forward of its own (the fix)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fake = self.generator(z)
        return self.discriminator(real), self.discriminator(fake.detach()), self.discriminator(fake)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    gan = GAN()
    ddp = DistributedDataParallel(gan)
    generator = list(gan.generator.parameters())
    opt_g = torch.optim.SGD(generator, lr=0.05)
    opt_d = torch.optim.SGD(gan.discriminator.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _step in range(20):
        z, real = torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g)
        opt_d.zero_grad()
        opt_g.zero_grad()
        d_real, d_fake_detached, d_fake = ddp(z, real)
        d_loss = d_fake_detached.mean() - d_real.mean()
        if "--separate" in sys.argv:
            d_loss.backward()
            g_loss = -ddp(z, real)[2].mean()
            g_loss.backward()
        elif "--inputs" in sys.argv:
            d_loss.backward(retain_graph=True)
            g_loss = -d_fake.mean()
            g_loss.backward(inputs=generator)
        else:
            d_loss.backward(retain_graph=True)
            g_loss = -d_fake.mean()
            g_loss.backward()
        opt_d.step()
        opt_g.step()
    dist.destroy_process_group()
