"""A curriculum trainer that computes the loss through `ddp.module`, so DDP never syncs.

The model is wrapped in DDP, but the trainer's `_get_model()` unwraps it and calls `compute_loss` on the inner
module. DDP's forward never runs, its reducer never fires, and each rank trains its own replica on its own shard.
Nothing fails; the replicas just drift apart. `--through-ddp` routes the loss through the wrapper (the fix).
Run: torchrun --nproc-per-node 2 examples/curriculum_through_module.py [--through-ddp]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import device_ids, setup, synthetic_loader, teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10))

    def compute_loss(self, batch: tuple[torch.Tensor, torch.Tensor], difficulty: float) -> torch.Tensor:
        x, y = batch
        noisy = x + difficulty * torch.randn_like(x)
        return F.cross_entropy(self.net(noisy), y)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor], difficulty: float) -> torch.Tensor:
        return self.compute_loss(batch, difficulty)


class CurriculumTrainer:
    def __init__(self, model: nn.Module, device: torch.device, *, through_ddp: bool) -> None:
        self.device = device
        self.model = DistributedDataParallel(model.to(device), device_ids=device_ids(device))
        self.through_ddp = through_ddp
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def _get_model(self) -> nn.Module:
        return self.model if self.through_ddp else self.model.module

    def train_stage(self, difficulty: float, epoch: int) -> float:
        loss = torch.zeros(())
        for x, y in synthetic_loader(epoch=epoch):
            batch = (x.to(self.device), y.to(self.device))
            if self.through_ddp:
                loss = self._get_model()(batch, difficulty)        # DDP's forward: gradients are all-reduced
            else:
                loss = self._get_model().compute_loss(batch, difficulty)   # bypasses DDP
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--through-ddp", action="store_true", help="compute the loss through the DDP wrapper")
    args = parser.parse_args()
    rank, device = setup()

    torch.manual_seed(0)
    trainer = CurriculumTrainer(Classifier(), device, through_ddp=args.through_ddp)
    for stage, difficulty in enumerate((0.0, 0.5, 1.0)):
        loss = trainer.train_stage(difficulty, epoch=stage)
        if rank == 0:
            print(f"stage {stage} (difficulty {difficulty}) loss {loss:.3f}")
    del trainer   # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
