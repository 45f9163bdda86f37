"""Lightning fit with a validation loop at each epoch end (a val_dataloader, an accuracy logged with
sync_dist=True): what `check` follows after its observed steps. Two ranks on CPU (`accelerator="cpu", devices=2`),
launched by torchrun; Lightning adds a DistributedSampler to both loaders: 32 training and 16 validation batches a
rank, 3 epochs. The process group's timeout is 20 s (DDPStrategy(timeout=...)).

--rank0-export S: at the end of each validation, rank 0 alone also runs the model over a long set (400 batches) at
S seconds a batch; with S=0.1 the others wait 40 s in the next epoch's first gradient all-reduce and time out.
Usage: torchrun --nproc-per-node 2 lightning_epochs.py ROOT_DIR [--rank0-export S]
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from datetime import timedelta

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("root_dir")
p.add_argument("--rank0-export", type=float, default=0.0)
opts = p.parse_args()


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        g = torch.Generator().manual_seed(0)
        self.train_set = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g))
        self.val_set = TensorDataset(torch.randn(128, 8, generator=g), torch.randint(0, 2, (128,), generator=g))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if opts.rank0_export and self.trainer.is_global_zero and not self.trainer.sanity_checking:
            with torch.no_grad():  # the wrong way: rank 0 alone, while the others go on to the next epoch
                for (x,) in DataLoader(TensorDataset(torch.randn(1600, 8)), batch_size=4):
                    time.sleep(opts.rank0_export)
                    self.net(x)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PrintAccuracy(pl.Callback):
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Classifier) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            print(f"epoch {trainer.current_epoch}: val_acc {float(trainer.callback_metrics['val_acc']):.3f}", flush=True)


def main() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=20)), max_epochs=3,
        default_root_dir=opts.root_dir,
        callbacks=[PrintAccuracy()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    trainer.fit(Classifier())
    # Free the DDP model before the process group goes: gloo (torch 2.13, CPU) otherwise aborts at interpreter exit
    # now and then ("terminate called without an active exception"), with or without ddp-doctor.
    del trainer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
