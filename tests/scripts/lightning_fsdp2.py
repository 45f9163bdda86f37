"""A Lightning job sharded with FSDP2 (`ModelParallelStrategy`, `fully_shard` in `configure_model`), on CPU and gloo.

Two ranks (`accelerator="cpu", devices=2`), launched by torchrun, which Lightning detects from the environment.

--mistake none            the blocks and the LightningModule itself sharded (clean)
--mistake root-unsharded  the blocks sharded, the LightningModule (with its head) not: the head trains apart
--save rank0              after the third batch, global rank 0 alone: torch.save(pl_module.state_dict(), "ck.pt")
--save every              after the third batch, every rank: trainer.save_checkpoint("ck") (a distributed
                          checkpoint folder, each rank writing its shards)
--save rank0-checkpoint   after the third batch, global rank 0 alone: trainer.save_checkpoint("ck") (it waits for
                          rank 1 in the distributed checkpoint's collectives, and the job hangs)
--full-checkpoint         ModelParallelStrategy(save_distributed_checkpoint=False): trainer.save_checkpoint gathers
                          the full state dict on every rank, and rank 0 writes one file
--callback                DoctorCallback(steps=6, fail_on="never") in the Trainer's callbacks
--out FOLDER              each rank writes what it measured to FOLDER/rank{r}.json: the head's full weight sum, and
                          the local / global shape of a weight in the file rank 0 saved

Usage: torchrun --nproc-per-node 2 lightning_fsdp2.py ROOT_DIR [--mistake ...] [--save ...] [--callback] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from ddp_doctor.integrations.lightning import DoctorCallback


class Regressor(pl.LightningModule):
    def __init__(self, shard_root: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 2)
        self.shard_root = shard_root

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        if self.shard_root:
            fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SaveAfterThirdBatch(pl.Callback):
    def __init__(self, how: str, folder: str) -> None:
        self.how, self.folder = how, folder

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.global_step != 3:
            return
        if self.how == "rank0" and trainer.is_global_zero:
            torch.save(pl_module.state_dict(), os.path.join(self.folder, "ck.pt"))
        elif self.how == "every" or self.how == "rank0-checkpoint" and trainer.is_global_zero:
            trainer.save_checkpoint(os.path.join(self.folder, "ck"))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root_dir")
    parser.add_argument("--mistake", choices=["none", "root-unsharded"], default="none")
    parser.add_argument("--save", choices=["", "rank0", "every", "rank0-checkpoint"], default="")
    parser.add_argument("--full-checkpoint", action="store_true")
    parser.add_argument("--callback", action="store_true")
    parser.add_argument("--out", default="")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*|.*LeafSpec.*")
    torch.manual_seed(int(os.environ.get("RANK", "0")))  # each rank's own initial head, as nothing broadcasts it
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # Lightning adds a DistributedSampler: 8 steps/epoch
    callbacks: list[pl.Callback] = []
    if opts.save:
        callbacks.append(SaveAfterThirdBatch(opts.save, opts.root_dir))
    if opts.callback:
        callbacks.append(DoctorCallback(steps=6, fail_on="never"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=not opts.full_checkpoint
        ),
        max_epochs=1,
        default_root_dir=opts.root_dir,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor(shard_root=opts.mistake != "root-unsharded")
    trainer.fit(model, loader)
    if opts.out:
        measured = {
            "head_sum": float(_full(model.head.weight).detach().sum()),
            "sharded_head": type(model.head.weight).__name__ == "DTensor",
        }
        saved = os.path.join(opts.root_dir, "ck.pt")
        if os.path.isfile(saved):
            weight = torch.load(saved, weights_only=False)["blocks.0.weight"]
            measured["saved_local"] = list(getattr(weight, "_local_tensor", weight).shape)
            measured["saved_global"] = list(weight.shape)
        with open(os.path.join(opts.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(measured, f)


if __name__ == "__main__":
    main()
