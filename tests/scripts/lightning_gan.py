"""A Lightning GAN with manual optimization: one `training_step` (which runs inside DDP's forward) computes the
discriminator's and the generator's losses and runs `manual_backward` twice, stepping two optimizers.

Usage: torchrun --nproc-per-node 2 lightning_gan.py ROOT_DIR [--strategy ddp|ddp_find_unused_parameters_true]
"""

from __future__ import annotations

import argparse
import gc
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(torch.randn(real.shape[0], 4))
        d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = -self.discriminator(fake).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.generator.parameters(), lr=0.05),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.05),
        ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root_dir")
    parser.add_argument("--strategy", default="ddp")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=torch.Generator().manual_seed(0)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # a DistributedSampler from Lightning: 6 steps/epoch
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=opts.strategy, max_epochs=1, default_root_dir=opts.root_dir,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(GAN(), loader)
    # Free the DDP model before the process group goes (see lightning_finetune.py).
    del trainer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
