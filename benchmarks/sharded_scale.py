"""What the FSDP2 report costs each rank at 2 to 1,024 ranks: bytes and collectives of `report()`, and its time.

    python -m benchmarks.sharded_scale [--json FILE] [--quick]

The FSDP2 and `replicate` report exchanges its rounds (`exchange/sharded_protocol.py`) over the group; this measures
them inside a real job, where `benchmarks/scale.py` measures DDP's protocol. Each row runs the real watch on a real FSDP2 model
(`fully_shard` on every residual block, the optimizer built after it, 8 observed steps), then counts the bytes this rank hands
to every `torch.distributed` collective while `report()` runs (`scale._count_bytes`) and times it.

Rows marked *real gloo* ran one process per rank over a real gloo group (a FileStore rendezvous); rank 0's figures
are shown. Rows marked *fake group* ran rank 0 alone in a group of W ranks on torch's `fake` backend
(`torch.testing._internal.distributed.fake_pg`): the same FSDP2 model sharded W ways, the same watch and the same
collectives, each returning this rank's own values (so every rank "agrees"). At 2, 4 and 8 ranks both ran and are
compared collective for collective, byte for byte. The rounds that name ranks apart run at 1,024 ranks in the
in-process model (`tests/exchange/test_sharded_exchange.py`).

Two jobs per size: *clean* (every block and the root sharded, nobody saves shards) and *mistakes* (the head left
outside every sharded group, and rank 0 alone saving `model.state_dict()`): the second takes every optional round
of the report (the unsharded parameters' fingerprints, the count of ranks that saved, what the first of them saved).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from scale import _count_bytes, _spawn  # noqa: E402  (beside this file, run as a script or a module)

STEPS = 8
WORLDS = (2, 8, 64, 1024)
REAL = (2, 4, 8)
TENSORS = (302, 3_002)
"""Parameter tensors of each model: blocks of a Linear and a LayerNorm (4 tensors), and a Linear head (2)."""
REPEATS = 5
"""`report()` runs this many times on the same watch; its time is the median (the bytes are the same each time)."""


class _Residual(torch.nn.Module):
    """A Linear and a LayerNorm (4 tensors) around a skip: a plain stack of 750 of them passes no gradient to its
    first blocks (their updates fall below float32's resolution), and the report rightly says `training-stalled`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


def _job(world: int, tensors: int, mistakes: bool, save_dir: str) -> dict[str, Any]:
    """Build, train and report on one FSDP2 model in this process (its group already initialised)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddp_doctor.doctor.plain_watch import PlainOptimizerWatch
    from ddp_doctor.observation import saves

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    blocks = [_Residual() for _ in range((tensors - 2) // 4)]
    model = nn.Sequential(*blocks, nn.Linear(16, 4))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    if not mistakes:
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)  # 750 blocks: larger steps overflow
    watch = PlainOptimizerWatch()
    optimizer.register_step_post_hook(lambda opt, _args, _kwargs: watch.on_step(opt))
    for step in range(STEPS):
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if mistakes and step == STEPS // 2 and dist.get_rank() == 0:
            path = os.path.join(save_dir, "model.pt")
            state = model.state_dict()
            torch.save(state, path)
            watch.note_save(saves.describe(state, path) or {})
    counts, undo = _count_bytes()
    times = []
    try:
        for i in range(REPEATS):
            before = dict(counts)
            t0 = time.perf_counter()
            report = watch.report()
            times.append(time.perf_counter() - t0)
            if i == 0:
                first = {k: counts[k] - before[k] for k in counts}
    finally:
        undo()
    assert watch.steps == STEPS, watch.steps
    return {**first, "report_s": statistics.median(times), "codes": sorted({f.code for f in report.findings})}


def _real_rank(rank: int, world: int, tensors: int, mistakes: bool, store: str, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            row = _job(world, tensors, mistakes, tmp)
        if rank == 0:
            out.send(row)
    finally:
        dist.destroy_process_group()


def real_row(world: int, tensors: int, mistakes: bool) -> dict[str, Any]:
    return _spawn(_real_rank, world, tensors, mistakes)


def fake_row(world: int, tensors: int, mistakes: bool) -> dict[str, Any]:
    """Rank 0 of a `fake` group of `world` ranks, in a fresh process (a process holds one default group)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import sharded_scale as s; "
        "print(json.dumps(s._fake_in_process(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == '1')))"
    )
    args = [sys.executable, "-c", code, str(Path(__file__).parent), str(world), str(tensors), "1" if mistakes else "0"]
    done = subprocess.run(args, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fake_in_process(world: int, tensors: int, mistakes: bool) -> dict[str, Any]:
    import resource

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            row = _job(world, tensors, mistakes, tmp)
        row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return row
    finally:
        dist.destroy_process_group()


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | tensors | job | measured on | sent / rank | received / rank | collectives | report() | findings |",
        "|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']:,} | {r['tensors']:,} | {r['job']} | {r['how']} | {r['sent']:,} B | "
            f"{r['received']:,} B | {r['collectives']} | {r['report_s'] * 1e3:.0f} ms | "
            f"{', '.join(r['codes']) or 'none'} |"
        )
    return "\n".join(lines)


def measure(quick: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """Every row, and the sentences that say where the real and the fake group moved the same bytes."""
    tensors = TENSORS[:1] if quick else TENSORS
    rows, checks = [], []
    for n in tensors:
        for mistakes in (False, True):
            job = "mistakes" if mistakes else "clean"
            for world in sorted(set(WORLDS) | set(REAL)):
                base = {"world": world, "tensors": n, "job": job}
                fake = {**base, "how": "fake group", **fake_row(world, n, mistakes)}
                if world in REAL:
                    real = {**base, "how": "real gloo", **real_row(world, n, mistakes)}
                    same = ("sent", "received", "collectives")
                    assert all(real[k] == fake[k] for k in same), (real, fake)
                    # The fake backend moves no values (FSDP2's reduce-scatter leaves its output as it found it):
                    # whether weights moved is not a fact there, so training-stalled may differ; nothing else may.
                    valued = {"training-stalled"}
                    assert set(real["codes"]) - valued == set(fake["codes"]) - valued, (real, fake)
                    checks.append(
                        f"W={world}, {n} tensors, {job}: the fake group moved the same bytes in the same "
                        f"{real['collectives']} collectives as the gloo group, and found the same codes but training-stalled (a fact of values, which the fake backend does not move)"
                    )
                    if world in WORLDS:
                        rows.append(real)
                elif world in WORLDS:
                    rows.append(fake)
                print(json.dumps(rows[-1] if world in WORLDS else base), flush=True)
    return rows, checks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help=f"{TENSORS[0]} tensors only")
    args = p.parse_args()
    rows, checks = measure(args.quick)
    print(markdown(rows))
    print("\n".join(checks))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
