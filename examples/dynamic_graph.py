"""A graph that changes with the step: an auxiliary loss on every other step, with static_graph=True.

static_graph=True promises DDP that the same parameters get gradients on every step. Here the auxiliary head
only joins the loss on even steps, so the promise is broken and DDP fails ("Your training graph has changed").
Run: torchrun --nproc-per-node 2 examples/dynamic_graph.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import device_ids, setup, synthetic_loader, teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class WithAuxiliary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.head = nn.Linear(128, 10)
        self.aux_head = nn.Linear(128, 32)   # reconstructs the input, as a regularizer

    def forward(self, x: torch.Tensor, with_aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.body(x)
        return self.head(h), (self.aux_head(h) if with_aux else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aux-every", type=int, default=2)
    args = parser.parse_args()
    rank, device = setup()

    torch.manual_seed(0)
    model = DistributedDataParallel(WithAuxiliary().to(device), device_ids=device_ids(device), static_graph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step, (x, y) in enumerate(synthetic_loader()):
        x, y = x.to(device), y.to(device)
        logits, recon = model(x, with_aux=step % args.aux_every == 0)
        loss = F.cross_entropy(logits, y)
        if recon is not None:
            loss = loss + 0.1 * F.mse_loss(recon, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 8 == 0:
            print(f"step {step:3d} loss {loss.item():.3f}")
    del model, opt   # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
