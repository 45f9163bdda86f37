"""Rank 0 saves a checkpoint at each epoch end and waits at a barrier inside its rank-0-only branch (the group's
timeout is 10 s, or GROUP_TIMEOUT_S): the other ranks go on to the next epoch, where DDP's gradient all-reduce
meets it.

    torchrun --nproc-per-node 2 tests/scripts/ckpt_barrier.py [--sync barrier|all-reduce]

`--sync all-reduce`: instead of the barrier, rank 0 averages its validation loss across the ranks inside the same
branch (`dist.all_reduce` of one float), which meets the other ranks' next gradient all-reduce.

With FR_DUMP_DIR set (and TORCH_FR_BUFFER_SIZE), a rank whose collective times out writes PyTorch's Flight Recorder
dump to FR_DUMP_DIR/rank_R, the file NCCL's watchdog writes on a timeout (gloo writes none itself), then fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", choices=("barrier", "all-reduce"), default="barrier")
    args = parser.parse_args()
    timeout = float(os.environ.get("GROUP_TIMEOUT_S", "10"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(96, 8), torch.randint(0, 2, (96,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(tempfile.gettempdir(), "ckpt.pt"))
            if args.sync == "barrier":
                dist.barrier()  # "everyone waits until the checkpoint is written": only rank 0 gets here
            else:
                val = F.cross_entropy(model.module(data.tensors[0][:8]), data.tensors[1][:8]).detach()
                dist.all_reduce(val)  # "the validation loss averaged across ranks": only rank 0 gets here
        print(f"rank {rank} epoch {epoch} done", flush=True)
    dist.destroy_process_group()


def _dump_flight_recorder() -> None:
    folder = os.environ.get("FR_DUMP_DIR")
    if folder:
        from torch._C._distributed_c10d import _dump_fr_trace

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank_{dist.get_rank()}"), "wb") as f:
            f.write(_dump_fr_trace(True, True, False))


if __name__ == "__main__":
    try:
        main()
    except RuntimeError:
        _dump_flight_recorder()
        raise
