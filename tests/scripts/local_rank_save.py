"""A DDP loop that saves its snapshot at each epoch end under `if local_rank == 0`, as pytorch/examples'
minGPT-ddp trainer does: one writer per node, not one per job.

    torchrun --nnodes 2 --nproc-per-node 1 ... tests/scripts/local_rank_save.py OUT_DIR   (once per node)

Each rank prints the files it wrote.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        if local_rank == 0:
            torch.save({"model": ddp.module.state_dict(), "epoch": epoch}, f"{out}/snapshot.pt")
            print(f"rank {rank} (local rank {local_rank}) wrote {out}/snapshot.pt at epoch {epoch}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
