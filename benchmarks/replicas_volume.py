"""Bytes per rank that guard's replica check and refreeze's preflight move, by world size, tensor count and outcome.

Starts its own gloo groups (W = 2, 4, 8 by default, on this machine, rendezvous through a FileStore), builds a DDP
model of K parameter tensors (4 elements each) on every rank, and counts, on every rank, the bytes of every tensor
passed to ``torch.distributed.all_reduce`` and received through ``all_gather`` while

- ``guard``: `Guard.check_now()` runs (the comparison `guard(every=N)` runs every N steps);
- ``refreeze``: refreeze's preflight runs (`agree_on_plan` and `require_identical_replicas`, with Adam's state).

Outcomes: "identical"; "diverged": the last rank's copy of every parameter differs; "apart": every rank holds its
own copy of every parameter (each rank trained its own replica), the most a comparison ever exchanges. The figures
are the maximum over the ranks. Usage: ``python benchmarks/replicas_volume.py [--worlds 2 4 8] [--tensors 300 10000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

__all__ = ["measure", "volume"]

_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_object")


def _rank(rank: int, world: int, store: str, k: int, conn: Any) -> None:
    try:
        conn.send(("ok", _measure_rank(rank, world, store, k)))
    except BaseException:  # noqa: BLE001  (the parent raises it with the rank's traceback)
        conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _measure_rank(rank: int, world: int, store: str, k: int) -> dict[str, dict[str, int]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_doctor import guard
    from ddp_doctor.core.errors import ReplicaDivergenceError
    from ddp_doctor.fixes.refreeze.preflight import agree_on_plan, require_identical_replicas

    torch.set_num_threads(1)
    logging.getLogger("ddp_doctor").setLevel(logging.CRITICAL)  # the guard's divergence warning is expected
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    counted = {"all_reduce": 0, "all_gather": 0, "calls": 0}
    real_reduce = dist.all_reduce

    def reduce(tensor, *args, **kwargs):
        counted["all_reduce"] += tensor.numel() * tensor.element_size()
        counted["calls"] += 1
        return real_reduce(tensor, *args, **kwargs)

    def gathering(name):
        real = getattr(dist, name)

        def call(*args, **kwargs):
            out = args[0] if args else kwargs.get("tensor_list", kwargs.get("output_tensor"))
            tensors = out if isinstance(out, list) else [out]
            counted["all_gather"] += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            counted["calls"] += 1
            return real(*args, **kwargs)

        return call

    def counting(fn) -> dict[str, int]:
        counted.update(all_reduce=0, all_gather=0, calls=0)
        dist.all_reduce = reduce
        for name in _GATHERS:
            setattr(dist, name, gathering(name))
        try:
            fn()
        finally:
            dist.all_reduce = real_reduce
            for name in _GATHERS:
                setattr(dist, name, getattr(torch.distributed.distributed_c10d, name))
        return dict(counted)

    torch.manual_seed(0)
    module = nn.Module()
    module.weights = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(k))
    ddp = DDP(module)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    for p in ddp.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # optimizer state exists: refreeze compares it too
    named = list(ddp.module.named_parameters())
    g = guard(ddp, every=10**9, optimizer=opt)
    device = torch.device("cpu")

    def preflight() -> None:
        agree_on_plan(named, [True] * len(named), None, group=None, device=device, timeout=60)
        try:
            require_identical_replicas(named, set(), opt, group=None, device=device)
        except ReplicaDivergenceError:
            pass

    result = {}
    for outcome, shift in (("identical", 0.0), ("diverged", float(rank == world - 1)), ("apart", float(rank))):
        with torch.no_grad():
            for p in ddp.parameters():
                p.add_(1e-3 * shift)
        result[f"guard {outcome}"] = counting(g.check_now)
        result[f"refreeze {outcome}"] = counting(preflight)
    g.close()
    dist.destroy_process_group()
    return result


def volume(world: int, k: int) -> dict[str, dict[str, int]]:
    """Run `world` ranks with `k` parameter tensors; per case, the most bytes any rank passed or received."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        pipes, procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank, args=(rank, world, str(Path(tmp) / "store"), k, child))
            p.start()
            child.close()
            pipes.append(parent)
            procs.append(p)
        outcomes = [conn.recv() for conn in pipes]
        for p in procs:
            p.join(timeout=60)
    errors = [detail for status, detail in outcomes if status != "ok"]
    if errors:
        raise RuntimeError("\n".join(errors))
    results = [detail for _, detail in outcomes]
    return {case: {key: max(r[case][key] for r in results) for key in results[0][case]} for case in results[0]}


def measure(worlds: list[int], tensors: list[int]) -> list[dict[str, Any]]:
    rows = []
    for k in tensors:
        for w in worlds:
            for case, c in volume(w, k).items():
                path, outcome = case.split()
                rows.append({"path": path, "tensors": k, "world": w, "outcome": outcome, **c})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tensors", type=int, nargs="+", default=[300, 10_000])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = measure(args.worlds, args.tensors)
    print("| path | tensors | W | outcome | all_reduce bytes | all_gather bytes | collectives |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["path"], r["tensors"], r["outcome"], r["world"])):
        print(
            f"| {r['path']} | {r['tensors']:,} | {r['world']} | {r['outcome']} | {r['all_reduce']:,} | "
            f"{r['all_gather']:,} | {r['calls']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
