"""A Lightning fit (strategy "ddp_find_unused_parameters_true", the optimizer stepping with a closure), long enough
for `ddp-doctor bench` to run every candidate in one launch: the DDP object the strategy holds is rebuilt in place."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 16, generator=g), torch.randint(0, 4, (4096,), generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_find_unused_parameters_true", max_steps=300,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Classifier(), DataLoader(data, batch_size=8))
