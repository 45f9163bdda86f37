"""Lightning fine-tuning that changes the frozen set mid-training (layers frozen after DDP was built; Lightning issue 20340), with DoctorCallback.

Lightning's own BackboneFinetuning freezes `backbone` before fit() builds DDP and unfreezes it at epoch 1; a user
callback freezes `neck` at epoch 1. Two ranks on CPU (`accelerator="cpu", devices=2`), launched by torchrun, which
Lightning detects from the environment.

Usage: torchrun --nproc-per-node 2 lightning_finetune.py ROOT_DIR [--strategy ddp|ddp_find_unused_parameters_true]
The callback's default fail_on="error" stops the run after the report: exit code 3, with the finding codes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn

from ddp_doctor.integrations.lightning import DoctorCallback, FindingsError


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(8, 16)
        self.neck = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.neck(torch.tanh(self.backbone(x)))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


class FreezeNeck(pl.Callback):
    """Gradual freezing: stop training the neck from epoch 1 on."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Classifier) -> None:
        if trainer.current_epoch == 1:
            pl_module.neck.requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root_dir")
    parser.add_argument("--strategy", default="ddp_find_unused_parameters_true")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # Lightning adds a DistributedSampler: 2 steps/epoch
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=opts.strategy, max_epochs=3, default_root_dir=opts.root_dir,
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False), FreezeNeck(),
                   DoctorCallback(steps=6)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    code = 0
    try:
        trainer.fit(Classifier(), loader)
    except FindingsError as exc:
        print(f"rank {trainer.global_rank} stopped by ddp-doctor: {sorted(f.code for f in exc.findings)}")
        code = 3
    # Free the DDP model before the process group goes: gloo (torch 2.13, CPU) otherwise aborts at interpreter exit
    # now and then ("terminate called without an active exception"), with or without ddp-doctor.
    del trainer
    gc.collect()
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
