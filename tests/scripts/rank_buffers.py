"""A buffer that differs across ranks (a per-rank seed) in a DDP model: made before the wrap, reassigned or
registered after it, with DDP's buffer broadcast on or off. Each rank writes OUT/rank{RANK}.json at the end: its
model's output on a fixed input (`probe`) and the largest difference across ranks of the weights (`weights_gap`).

    torchrun --nproc-per-node 2 tests/scripts/rank_buffers.py OUT --case CASE [--broadcast-buffers]

cases:
  drawn-per-rank   `scale` drawn from each rank's own seed in the model's constructor, before the wrap
  reassigned       `model.module.scale = ...` from each rank's own seed after the wrap
  registered       `model.module.register_buffer("shift", ...)` from each rank's own seed after the wrap
  same-seed        `scale` drawn from one seed on every rank (clean)
  batchnorm        a BatchNorm1d whose running statistics each rank updates from its own batches
  bufferless       no buffer when DDP is built; `shift` registered from each rank's own seed after the wrap
                   (DDP syncs buffers only when the model had some when it was built: never, even with
                   --broadcast-buffers)
  opaque           as bufferless, with `shift` held in a tensor subclass whose operations only its own
                   `dequantize()` supports (as a quantized weight's), and a frozen parameter `codebook` of that
                   subclass attached after the wrap: the check cannot read either
  opaque-at-wrap   that `shift` registered before the wrap, from each rank's own seed (with broadcast_buffers=False
                   DDP takes it, and never broadcasts it)
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Opaque(torch.Tensor):
    """A tensor subclass that supports only detach and its own `dequantize()`: no sum, no conversion."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Opaque:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return Opaque(args[0]._data)
        raise NotImplementedError(f"Opaque does not support {func}")

    def dequantize(self) -> torch.Tensor:
        return self._data


class Net(nn.Module):
    def __init__(self, seed: int, batchnorm: bool, scale: bool = True) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8) if batchnorm else nn.Identity()
        self.head = nn.Linear(8, 4)
        if scale:
            self.register_buffer("scale", torch.rand(8, generator=torch.Generator().manual_seed(seed)) + 0.5)
        else:
            self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = getattr(self, "shift", None)
        if isinstance(shift, Opaque):
            shift = shift.dequantize()
        x = x * self.scale + (shift if shift is not None else 0.0)
        return self.head(torch.relu(self.norm(self.body(x))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--case", required=True)
    parser.add_argument("--broadcast-buffers", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    bufferless = args.case in ("bufferless", "opaque")
    net = Net(seed=rank if args.case == "drawn-per-rank" else 0, batchnorm=args.case == "batchnorm", scale=not bufferless)
    own = torch.Generator().manual_seed(100 + rank)
    if args.case == "opaque-at-wrap":  # (DDP cannot broadcast it: broadcast_buffers=False only)
        net.register_buffer("shift", Opaque(torch.rand(8, generator=own)))
    model = DistributedDataParallel(net, broadcast_buffers=args.broadcast_buffers)
    if args.case == "reassigned":
        model.module.scale = torch.rand(8, generator=own) + 0.5  # after the wrap, each rank its own
    elif args.case in ("registered", "bufferless"):
        model.module.register_buffer("shift", torch.rand(8, generator=own))  # after the wrap, each rank its own
    elif args.case == "opaque":
        model.module.register_buffer("shift", Opaque(torch.rand(8, generator=own)))
        model.module.codebook = nn.Parameter(Opaque(torch.ones(4)), requires_grad=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        loss = model(torch.randn(16, 8, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        model.eval()
        probe = float(model(torch.ones(2, 8)).sum())
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        got = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
        dist.all_gather(got, weights)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"probe": probe, "weights_gap": max(float((g - got[0]).abs().max()) for g in got)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
