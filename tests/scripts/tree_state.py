"""State that DDP's lists made at wrap time do not cover: a parameter or module that arrives after DDP was built, a
module mode that differs across ranks, and clean neighbours. Each rank writes what it measured at the end to
OUT/rank{RANK}.json: the largest difference across ranks of the model's parameters, by name.

    torchrun --nproc-per-node 2 tests/scripts/tree_state.py OUT --case CASE [--find-unused] [--steps N]

cases:
  replace-head   model.module.head = nn.Linear(...) after DDP was built (a new task head)
  new-param      model.module.scale = nn.Parameter(...) after DDP was built; forward multiplies by it
  eval-rank0     rank 0 evaluates at step 2 with model.eval() and never calls model.train() again
  dropout-off-rank0  rank 0 alone switches its Dropout layers to eval mode after step 2 (a callback of the main
                 process that turns dropout off late in training); the model itself stays in train mode
  lazy-after-wrap  a LazyLinear added to the model after DDP was built, never run (its parameters hold no data)
  meta-after-wrap  a Linear on the meta device added after DDP was built, never run (no data either)
  eval-restored  every rank evaluates through model.module at step 2, then calls model.train() (clean)
  ema-inside     an EMA copy kept inside the module tree, not trained, updated from the synced weights (clean)
  replace-after-opt  the head replaced after DDP and the optimizer were built: the optimizer steps the old head
  tie-after-wrap  a model of two heads, head.weight tied to aux.weight after DDP was built
  tie-before-wrap the same tie made before DDP was built (clean)
  cast-after-wrap  model.to(torch.bfloat16) after DDP was built
  cast-before-wrap the same cast before DDP was built (clean)
  outside-param  a learnable loss temperature kept beside the model, stepped by the same optimizer
  outside-synced the same temperature and nine offsets beside it, their gradients all-reduced by the script
                 before the step (clean)
  outside-own-opt the temperature stepped by an optimizer of its own (Adam), not the model's
  outside-seeded the temperature drawn from each rank's own seed, its gradient all-reduced by the script
  outside-registered the temperature registered on the model before DDP was built, read through .module (clean)
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.body(x))
        scale = getattr(self, "scale", None)
        return out * scale if scale is not None else out


class TwoHeads(nn.Module):
    """Two heads over one body, summed: their weights can be tied (`head.weight = aux.weight`)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4, bias=False)
        self.aux = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + self.aux(h)


def gaps(model: nn.Module) -> dict[str, float]:
    out = {}
    for name, p in model.named_parameters():
        if p.is_meta or nn.parameter.is_lazy(p):  # no data to compare
            continue
        mine = p.detach().float().contiguous()
        got = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(got, mine)
        out[name] = max(float((g - got[0]).abs().max()) for g in got)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--case", required=True)
    parser.add_argument("--find-unused", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = TwoHeads() if args.case.startswith("tie-") else Net()
    if args.case == "tie-before-wrap":
        net.head.weight = net.aux.weight
    if args.case == "cast-before-wrap":
        net = net.to(torch.bfloat16)
    if args.case == "outside-registered":
        net.temp = nn.Parameter(torch.zeros(()))
    model = DistributedDataParallel(net, find_unused_parameters=args.find_unused)
    if args.case == "cast-after-wrap":
        model = model.to(torch.bfloat16)  # cast after the wrap
    if args.case == "tie-after-wrap":
        model.module.head.weight = model.module.aux.weight  # tied after the wrap
    if args.case == "replace-head":
        torch.manual_seed(1)
        model.module.head = nn.Linear(16, 4)
    elif args.case == "new-param":
        model.module.scale = nn.Parameter(torch.ones(4))
    elif args.case == "lazy-after-wrap":
        model.module.probe = nn.LazyLinear(4)  # for a later phase; the forward never calls it
    elif args.case == "meta-after-wrap":
        model.module.probe = nn.Linear(16, 4, device="meta")
    elif args.case == "ema-inside":
        model.module.ema = copy.deepcopy(nn.Sequential(model.module.body, model.module.head)).requires_grad_(False)
    temp = model.module.temp if args.case == "outside-registered" else None
    if args.case in ("outside-param", "outside-synced", "outside-own-opt"):
        temp = nn.Parameter(torch.zeros(()))  # a learnable loss temperature beside the model
    if args.case == "outside-seeded":
        temp = nn.Parameter(torch.rand((), generator=torch.Generator().manual_seed(rank)))
    extra = [temp] if temp is not None and args.case != "outside-registered" else []
    offsets = [nn.Parameter(torch.zeros(())) for _ in range(9)] if args.case == "outside-synced" else []
    extra += offsets
    own = torch.optim.Adam(extra, lr=0.01) if args.case == "outside-own-opt" else None
    opt = torch.optim.SGD([*model.parameters(), *(extra if own is None else [])], lr=0.1)
    if args.case == "replace-after-opt":
        torch.manual_seed(1)
        model.module.head = nn.Linear(16, 4)  # after the optimizer was built: it still holds the old head
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(16, 8, generator=g).to(next(model.parameters()).dtype)
        out = model(x).float()
        loss = (out / temp.exp() + sum(offsets) if temp is not None else out).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if args.case in ("outside-synced", "outside-seeded"):
            for t in [temp, *offsets]:
                dist.all_reduce(t.grad)
                t.grad /= dist.get_world_size()
        opt.step()
        if own is not None:
            own.step()
            own.zero_grad()
        if args.case == "ema-inside":
            with torch.no_grad():
                src = [*model.module.body.parameters(), *model.module.head.parameters()]
                for e, p in zip(model.module.ema.parameters(), src):
                    e.mul_(0.9).add_(p, alpha=0.1)
        if step == 2 and args.case == "eval-rank0" and rank == 0:
            model.eval()
            with torch.no_grad():
                model.module(torch.randn(4, 8, generator=g))
        if step == 2 and args.case == "dropout-off-rank0" and rank == 0:
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.eval()
        if step == 2 and args.case == "eval-restored":
            model.eval()
            with torch.no_grad():
                model.module(torch.randn(4, 8, generator=g))
            model.train()
    measured = {
        "gaps": gaps(model.module)
        | ({"temp": gaps(nn.ParameterList([temp]))["0"]} if extra else {})
        | ({f"offset{i}": v for i, v in gaps(nn.ParameterList(offsets)).items()} if offsets else {}),
        "training": model.training,
        "dropout_training": [m.training for m in model.modules() if isinstance(m, nn.Dropout)],
        "head_sum": float(model.module.head.weight.sum()),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(measured, f)
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
