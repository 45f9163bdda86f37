"""FSDP2 (`fully_shard`) on a GPU: the model of fsdp2_train.py on `cuda:LOCAL_RANK` (modulo the GPUs there), with
NCCL or gloo, clean or with one of the silent mistakes. For the GPU-only tests (tests/fsdp2/test_check_fsdp2_gpu.py).

--mistake none | optimizer-before | sync-off
--backend nccl | gloo
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", default="none")
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if args.mistake == "optimizer-before":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    if args.mistake != "optimizer-before":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator(device=device).manual_seed(rank)
    for _step in range(args.steps):
        for _micro in range(2):
            if args.mistake == "sync-off":
                model.set_requires_gradient_sync(False)
            x = torch.randn(8, 16, generator=g, device=device)
            y = torch.randint(0, 4, (8,), generator=g, device=device)
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    moved = max(p.full_tensor().detach().sub(before[n]).abs().max().item() for n, p in model.named_parameters())
    print(f"rank {rank} on {device} ({args.backend}): largest weight change {moved:.3g}", flush=True)
    dist.destroy_process_group()
