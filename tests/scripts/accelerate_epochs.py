"""An Accelerate training loop with an evaluation at each epoch end: what `check` follows after its observed steps.

The training and evaluation loaders are prepared together (Accelerate rebuilds both, at one line of its own, as
DataLoaderShard, which reads one batch ahead); every rank evaluates its shard and the accuracy is gathered with
gather_for_metrics. The process group's timeout is 20 s (InitProcessGroupKwargs).

--eval-rank0 S: instead, rank 0 alone evaluates a long plain loader (400 batches) at S seconds a batch; with S=0.1 the
others wait 40 s in their next collective and time out (the plain run dies at the start of epoch 2).
Usage: torchrun --nproc-per-node 2 accelerate_epochs.py [--epochs N] [--eval-rank0 S]
"""

from __future__ import annotations

import argparse
import gc
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from accelerate import Accelerator, InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--eval-rank0", type=float, default=0.0)
args = p.parse_args()


def main() -> None:
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=20))])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g))
    held = TensorDataset(torch.randn(128, 8, generator=g), torch.randint(0, 2, (128,), generator=g))
    train_loader = DataLoader(train, batch_size=4, shuffle=True)  # 32 batches a rank
    eval_loader = DataLoader(held, batch_size=4)  # 16 batches a rank
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    long_eval = DataLoader(TensorDataset(torch.randn(1600, 8, generator=g)), batch_size=4)  # not prepared
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        if args.eval_rank0:
            if accelerator.is_main_process:
                with torch.no_grad():
                    for (x,) in long_eval:
                        time.sleep(args.eval_rank0)
                        accelerator.unwrap_model(model)(x)
            continue
        correct = total = 0
        with torch.no_grad():
            for x, y in eval_loader:
                hits = accelerator.gather_for_metrics(model(x).argmax(-1) == y)
                correct, total = correct + int(hits.sum()), total + hits.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f} on {total} samples")
    # Free the DDP model (prepare() keeps a reference in the Accelerator) before end_training() destroys the process
    # group: gloo (torch 2.13, CPU) otherwise aborts at interpreter exit now and then.
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
