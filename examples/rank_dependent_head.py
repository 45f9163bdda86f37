"""A graph that differs by rank: only rank 0 adds an auxiliary loss, with find_unused_parameters=True.

Rank 0 owns the labels of an auxiliary task, so only it adds the auxiliary head's loss; the other ranks never touch
the head. find_unused_parameters=True copes (it finds the head unused on the other ranks every step), but it walks
the autograd graph on every step to do so. The used set differs by rank yet never changes from step to step, which
is the case static_graph=True handles without the walk.
Run: torchrun --nproc-per-node 2 examples/rank_dependent_head.py
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
        self.aux_head = nn.Linear(128, 32)   # reconstructs the input: a task whose labels only rank 0 has

    def forward(self, x: torch.Tensor, with_aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.body(x)
        return self.head(h), (self.aux_head(h) if with_aux else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    rank, device = setup()

    torch.manual_seed(0)
    model = DistributedDataParallel(WithAuxiliary().to(device), device_ids=device_ids(device),
                                    find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(synthetic_loader(epoch=epoch)):
            x, y = x.to(device), y.to(device)
            logits, recon = model(x, with_aux=rank == 0)
            loss = F.cross_entropy(logits, y)
            if recon is not None:
                loss = loss + 0.1 * F.mse_loss(recon, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step:3d} loss {loss.item():.3f}")
    del model, opt   # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
