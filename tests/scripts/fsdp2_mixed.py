"""FSDP2 with a mixed-precision policy: compute in bfloat16, reduce in bfloat16 or float32.

--policy bf16        MixedPrecisionPolicy(param_dtype=torch.bfloat16): reduce_dtype unset, so FSDP2 reduces the
                     gradients in bfloat16 while the sharded float32 weights train
--policy bf16-fp32   MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
--policy bf16-weights the bf16 policy on a model cast to bfloat16 first (`model.to(torch.bfloat16)`): the sharded
                     weights the optimizer steps are bfloat16 too, and updates below their resolution are lost
--policy default-bf16 the bf16 policy on a model built after torch.set_default_dtype(torch.bfloat16) (a script that
                     saves memory so): its weights are bfloat16 from the start
--policy assign-bf16 the bf16 policy on a model that loads a bfloat16 checkpoint with load_state_dict(..., assign=True)
                     (the checkpoint's tensors replace the float32 ones, dtype included)
--lr                 AdamW's learning rate (default 1e-2)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", default="bf16")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if args.policy == "default-bf16":
        torch.set_default_dtype(torch.bfloat16)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    torch.set_default_dtype(torch.float32)
    if args.policy == "bf16-weights":
        model.to(torch.bfloat16)
    if args.policy == "assign-bf16":  # a checkpoint saved in bfloat16, as many published ones are
        checkpoint = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        model.load_state_dict(checkpoint, assign=True)
    first = model[0].weight.detach().clone()
    reduce = torch.float32 if args.policy == "bf16-fp32" else None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(rank)
    for _step in range(args.steps):
        x, y = torch.randn(8, 16, generator=g, dtype=torch.float32), torch.randint(0, 4, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    weight = model[0].weight.full_tensor()
    unchanged = (weight == first).double().mean().item()
    print(
        f"rank {rank}: loss {loss.item():.4f}, first weight sum {weight.double().sum().item():.6f}, "
        f"{weight.dtype}, unchanged {unchanged:.1%}",
        flush=True,
    )
    dist.destroy_process_group()
