"""Uneven inputs handled by `Join`: rank r has BATCHES + 3 r batches per epoch, for 2 epochs, and trains them inside
`Join([model])` (or `model.join()`), so the rank that runs out shadows the others' collectives. Rank 0 prints the
largest difference across ranks of the weights at the end.

    torchrun --nproc-per-node 2 tests/scripts/joined.py [--batches 5] [--api join|model-join] [--loader list]
        [--throw]

--throw: Join(..., throw_on_early_termination=True): once a rank runs out, every rank raises at its next join hook,
and the script catches it and ends the epoch there (every rank trains the same number of batches).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--api", default="join", choices=["join", "model-join"])
    parser.add_argument("--loader", default="dataloader", choices=["dataloader", "list"])
    parser.add_argument("--throw", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(16 * (args.batches + 3 * rank), 8, generator=torch.Generator().manual_seed(rank))
    loader = DataLoader(TensorDataset(data), batch_size=16) if args.loader == "dataloader" else data.split(16)
    for _epoch in range(2):
        try:
            with Join([model], throw_on_early_termination=args.throw) if args.api == "join" else model.join(
                throw_on_early_termination=args.throw
            ):
                for batch in loader:
                    x = batch[0] if isinstance(batch, list) else batch
                    loss = model(x).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        except RuntimeError as exc:
            if not args.throw or "exhausted" not in str(exc):
                raise
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    got = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(got, weights)
    if rank == 0:
        print(f"weights gap {max(float((g - got[0]).abs().max()) for g in got):.3e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
