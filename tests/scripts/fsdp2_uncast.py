"""An FSDP2 job whose mixed-precision policy runs its modules in bfloat16, fed float32 batches. `--no-cast`: the
policy has cast_forward_inputs=False, so the float32 batch reaches the first block's bfloat16 weights; `--root-
unsharded`: the blocks are sharded with the policy but the root is not, so its float32 head gets the last block's
bfloat16 output. Without either, every module is sharded with the default policy, which casts the inputs: clean."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs="--no-cast" not in sys.argv)
    for block in (model[0], model[2]):
        fully_shard(block, mp_policy=policy)
    if "--root-unsharded" not in sys.argv:
        fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(12):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
