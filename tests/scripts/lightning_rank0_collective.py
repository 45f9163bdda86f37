"""A Lightning callback that all-reduces a metric on rank 0 only at each epoch end (`if trainer.is_global_zero`):
the other rank goes on into Lightning's own collectives, and the job hangs until the group's timeout (10 s).

    torchrun --nproc-per-node 2 tests/scripts/lightning_rank0_collective.py ROOT_DIR
"""

from __future__ import annotations

import datetime
import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class GlobalMetric(pl.Callback):
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            total = torch.ones(1)
            dist.all_reduce(total)  # "sum a metric over the ranks", on rank 0 only
            print("metric", total.item(), flush=True)


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=pl.strategies.DDPStrategy(timeout=datetime.timedelta(seconds=10)),
        max_epochs=3,
        callbacks=[GlobalMetric()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=sys.argv[1],
    )
    trainer.fit(Net(), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
