"""What a rank sees of its interpreter, written to OUT/rank{RANK}.json before it trains a small DDP model.

Run: torchrun --nproc-per-node 2 tests/scripts/warm_probe.py OUT [--loaders] [--steps N]

With --loaders the script first calls `multiprocessing.set_start_method("spawn")` (which fails in a process whose
start method is already chosen), then reads a small dataset through DataLoader workers started with fork, spawn and
forkserver in turn. Workers started by spawn and forkserver import this file again as `__mp_main__`: everything
below runs under `if __name__ == "__main__":` only.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i * i)])


def _cmdline(pid: int) -> str:
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:300]


def _parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def probe(out: str, loaders: bool) -> dict:
    facts = {
        "name": __name__,
        "file": __file__,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "env": dict(os.environ),
        "process": mp.current_process().name,
        "parent_process": mp.parent_process() is not None,
        "start_method": mp.get_start_method(allow_none=True),
        "session_leader": os.getsid(0) == os.getpid(),
        "random": random.random(),
        "numpy": float(np.random.rand()),
        "torch_rand": float(torch.rand(1)),
        "threads": torch.get_num_threads(),
        "cuda_initialized": torch.cuda.is_initialized(),
        "parent_tasks": len(os.listdir(f"/proc/{os.getppid()}/task")),
        "parent_cmdline": _cmdline(os.getppid()),
        "grandparent_cmdline": _cmdline(_parent_of(os.getppid())),
    }
    if loaders:
        mp.set_start_method("spawn")
        facts["start_method_set"] = mp.get_start_method()
        sums = {}
        for method in ("fork", "spawn", "forkserver"):
            loader = DataLoader(Squares(), batch_size=4, num_workers=1, multiprocessing_context=method)
            sums[method] = float(sum(batch.sum() for batch in loader))
        facts["loader_sums"] = sums
    return facts


def main() -> None:
    out = sys.argv[1]
    loaders = "--loaders" in sys.argv
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 4
    rank = int(os.environ["RANK"])
    facts = probe(out, loaders)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
