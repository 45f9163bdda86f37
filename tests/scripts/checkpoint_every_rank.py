"""Every rank saves the checkpoint to the same file (no rank guard), the wrapper's state dict, then the script ends
before `check`'s steps are done. With --rank0, rank 0 alone saves the inner model's state dict, then a barrier."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _train import model, train
from torch.nn.parallel import DistributedDataParallel

if __name__ == "__main__":
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model())
    train(ddp, steps=3)
    path = sys.argv[sys.argv.index("--out") + 1]
    if "--rank0" in sys.argv:
        if dist.get_rank() == 0:
            torch.save(ddp.module.state_dict(), path)
        dist.barrier()
    else:
        torch.save({"model": ddp.state_dict(), "step": 3}, path)
    dist.destroy_process_group()
