"""What the check costs each rank at 2 to 1,024 ranks: bytes through the exchange, analysis time and memory.

    python -m benchmarks.scale [--json FILE] [--quick]

Rows at world sizes up to 8 run the real exchange (`ddp_doctor.exchange.runner.exchange`) over real gloo process groups
(one process per rank, a FileStore rendezvous). Larger world sizes run the model of the same code path:
`ddp_doctor.exchange.summarize` runs every rank's real `protocol` (the real packing, on each rank's own synthetic
record) in lockstep in one process and computes each collective's result as the reduction computes it, checking
that every rank issued the same collective with the same shape. The rows measured both ways are compared byte for
byte. The analysis (`analyze_summary`) is the real one in both cases: its time is the median of 5 runs, its memory
the growth of the peak RSS of a fresh process while it runs.

Each synthetic job has 8 observed steps, one rank that never uses one parameter (a rank-dependent graph) and one
whose weights diverge after step 5, so that the second round (naming ranks) and the strings round run; names are
MoE-like (``layers.12.experts.3.w1.weight``). "before" is the all_gather exchange this replaced, computed from its
packing (`RankRecord.packed_size`): every rank received every rank's record and metadata.

Also measured on real groups: `guard` (creation, a replica comparison, one that finds a divergence) and
`refreeze`, bytes per rank through every torch.distributed collective they call. And the FSDP2 report's exchange
(`benchmarks/sharded_scale.py`, which this runs too): real gloo groups up to 8 ranks, torch's `fake` backend up to
1,024.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import multiprocessing as mp
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

STEPS = 8
WORLDS = (2, 64, 1024)
TENSORS = (300, 10_000)
REAL_MAX = 8


# ------------------------------------------------------------------------------------------------ synthetic jobs


def make_info(params: int) -> Any:
    from ddp_doctor.core.records import ModelInfo

    names = [f"layers.{i // 32}.experts.{(i // 4) % 8}.w{i % 4}.weight" for i in range(params)]
    return ModelInfo(
        param_names=names,
        param_shapes=[(256, 64)] * params,
        trainable_at_wrap=[True] * params,
        ignored=[False] * params,
        buffer_names=[],
        buffer_shapes=[],
        ddp_config={
            "find_unused_parameters": False,
            "static_graph": True,
            "gradient_as_bucket_view": False,
            "broadcast_buffers": True,
        },
    )


def _clean(params: int) -> dict[str, torch.Tensor]:
    from ddp_doctor.core.records import StepCounters

    g = torch.Generator().manual_seed(0)
    used = torch.ones(STEPS, params, dtype=torch.bool)
    c = StepCounters(ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1)
    return {
        "used": used,
        "reachable": used,
        "ran": used,
        "trainable": used,
        "grad_fp": torch.randn(STEPS, params, 2, generator=g, dtype=torch.float64),
        "weight_fp": torch.randn(STEPS + 1, params, 2, generator=g, dtype=torch.float64),
        "buffer_fp": torch.zeros(STEPS, 0, 2, dtype=torch.float64),
        "counters": torch.tensor([c.as_list()] * STEPS),
    }


def make_record(rank: int, world: int, params: int, clean: dict[str, torch.Tensor] | None = None) -> Any:
    """Rank `rank`'s record. Ranks other than the two odd ones share `clean`'s tensors (the model of 1,024 ranks
    then fits in memory); inputs and timings are the rank's own."""
    from ddp_doctor.core.records import TIMING_COLUMNS, RankRecord

    fields = dict(clean if clean is not None else _clean(params))
    if rank == world // 3:
        fields["used"] = fields["used"].clone()
        fields["used"][:, 7] = False
    if rank == 2 * world // 3:
        fields["weight_fp"] = fields["weight_fp"].clone()
        fields["weight_fp"][6:, :3] += 1.0
    g = torch.Generator().manual_seed(1000 + rank)
    return RankRecord(
        rank=rank,
        input_fp=torch.randn(STEPS, 2, generator=g, dtype=torch.float64),
        timing=0.01 + 0.001 * torch.rand(STEPS, TIMING_COLUMNS, generator=g, dtype=torch.float64),
        **fields,
    )


def before_bytes(world: int, params: int) -> dict[str, int]:
    """The replaced exchange: an agree() all_gather of 6 float64, then all_gathers of the padded record and of
    the JSON metadata (record meta + the whole ModelInfo)."""
    from ddp_doctor.core.records import RankRecord

    info = make_info(params)
    rec = make_record(0, world, params)
    # the record's plain fields (not its per-step tensors), as the replaced exchange sent them
    plain = {
        f.name: getattr(rec, f.name)
        for f in dataclasses.fields(rec)
        if f.name not in (*RankRecord.TENSOR_FIELDS, "rank", "synced_grad_fp")
    }
    meta = len(json.dumps({"record": plain, "info": info.to_dict()}).encode())
    per_rank = 6 * 8 + RankRecord.packed_size(STEPS, params, 0) * 8 + meta
    return {"sent": per_rank, "received": world * per_rank}


# ------------------------------------------------------------------------------------------------ measurements


def analysis_cost(summary: Any) -> dict[str, float]:
    """Median seconds of `analyze_summary` over 5 runs here; the size of its input (the `Summary`, pickled); and
    the growth of the peak RSS of a fresh process (torch imported, the summary loaded) while it runs."""
    from ddp_doctor.analyze import analyze_summary

    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        analyze_summary(summary)
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "summary.pkl"
        path.write_bytes(pickle.dumps(summary))
        code = (
            "import pickle, resource, sys, torch; torch.set_num_threads(1); "
            "from ddp_doctor.analyze import analyze_summary; "
            "import ddp_doctor.analyze.snippets; "
            "s = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; analyze_summary(s); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)"
        )
        out = subprocess.run([sys.executable, "-c", code, str(path)], check=True, capture_output=True, text=True)
    return {
        "analysis_s": statistics.median(times),
        "analysis_peak_mb": int(out.stdout.split()[-1]) / 1024,
        "summary_mb": len(pickle.dumps(summary)) / 1024**2,
    }


def model_row(world: int, params: int) -> dict[str, Any]:
    from ddp_doctor.exchange import summarize

    clean = _clean(params)
    records = [make_record(r, world, params, clean) for r in range(world)]
    t0 = time.perf_counter()
    summary = summarize(make_info(params), records)
    elapsed = time.perf_counter() - t0
    del records
    return {
        "world": world,
        "tensors": params,
        "how": "model",
        "sent": summary.volume.sent,
        "received": summary.volume.received,
        "collectives": summary.volume.collectives,
        "rounds": summary.volume.rounds,
        "model_s": elapsed,
        **analysis_cost(summary),
        "codes": _codes(summary),
    }


def _codes(summary: Any) -> list[str]:
    from ddp_doctor.analyze import analyze_summary

    return sorted({f.code for f in analyze_summary(summary).findings})


def _real_rank(rank: int, world: int, params: int, store: str, out: Any) -> None:
    import torch.distributed as dist

    from ddp_doctor.exchange.runner import exchange

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    try:
        record = make_record(rank, world, params)
        dist.barrier()
        t0 = time.perf_counter()
        summary = exchange(record, make_info(params), timeout=600, tag="scale", device=torch.device("cpu"))
        elapsed = time.perf_counter() - t0
        if rank == 0:
            out.send(
                {
                    "world": world,
                    "tensors": params,
                    "how": "real gloo",
                    "sent": summary.volume.sent,
                    "received": summary.volume.received,
                    "collectives": summary.volume.collectives,
                    "rounds": summary.volume.rounds,
                    "exchange_s": elapsed,
                    **analysis_cost(summary),
                    "codes": _codes(summary),
                }
            )
    finally:
        dist.destroy_process_group()


def _spawn(target: Any, world: int, *args: Any) -> Any:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, world, *args, store, child)) for r in range(world)]
        for p in procs:
            p.start()
        result = parent.recv()
        for p in procs:
            p.join(timeout=600)
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return result


def real_row(world: int, params: int) -> dict[str, Any]:
    return _spawn(_real_rank, world, params)


# ------------------------------------------------------------------------------------------------ guard, refreeze


_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_gather_object",
    "broadcast_object_list",
    "reduce_scatter",
)


def _count_bytes() -> tuple[dict[str, int], Any]:
    """Patch torch.distributed's collectives to count this rank's bytes in and out; returns (counts, undo)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counts = {"sent": 0, "received": 0, "collectives": 0}
    originals = {n: getattr(c10d, n) for n in _COUNTED}

    def size(t: Any) -> int:
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        if isinstance(t, (list, tuple)):
            return sum(size(x) for x in t)
        return len(pickle.dumps(t))

    def wrap(name: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts["collectives"] += 1
            if name in ("all_gather", "all_gather_into_tensor", "all_gather_object"):
                out, local = args[0], args[1]
                counts["sent"] += size(local)
                counts["received"] += size(out) if name != "all_gather_object" else size(local) * len(out)
            else:
                counts["sent"] += size(args[0])
                counts["received"] += size(args[0])
            return originals[name](*args, **kwargs)

        return counted

    for n in _COUNTED:
        for ns in (dist, c10d):
            setattr(ns, n, wrap(n))

    def undo() -> None:
        for n, fn in originals.items():
            for ns in (dist, c10d):
                setattr(ns, n, fn)

    return counts, undo


def _guard_rank(rank: int, world: int, depth: int, store: str, out: Any) -> None:
    import logging

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_doctor import guard, refreeze

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # the divergence this measures is expected: no warning
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(8, 8), nn.LayerNorm(8))])
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        figures = {}
        counts, undo = _count_bytes()
        try:

            def measure(name: str, fn: Any) -> Any:
                before = dict(counts)
                result = fn()
                figures[name] = {k: counts[k] - before[k] for k in counts}
                return result

            g = measure("guard()", lambda: guard(ddp, every=1_000_000, optimizer=opt))
            measure("guard: compare, identical", g.check_now)
            measure("refreeze", lambda: refreeze(ddp, opt, freeze=["0.weight", "0.bias"], timeout=600))
            if rank == 1:
                with torch.no_grad():
                    model[2].weight.add_(1.0)
            measure("guard: compare, rank 1 diverged", g.check_now)
        finally:
            undo()
        if rank == 0:
            out.send({"world": world, "tensors": 4 * depth, "figures": figures})
        # DDP's reducer and the guard hold the group: freed during interpreter shutdown, gloo can abort the
        # process ("terminate called without an active exception"; see examples/common.py).
        g = opt = ddp = model = None
        gc.collect()
    finally:
        dist.destroy_process_group()


def guard_rows(worlds: tuple[int, ...], depth: int) -> list[dict[str, Any]]:
    return [_spawn(_guard_rank, w, depth) for w in worlds]


# ------------------------------------------------------------------------------------------------ the table


def _kb(n: float) -> str:
    return f"{n / 1024:,.0f} KB" if n < 1024**2 * 10 else f"{n / 1024**2:,.1f} MB"


def markdown(rows: list[dict[str, Any]], guards: list[dict[str, Any]]) -> str:
    head = (
        "| ranks | tensors | measured on | sent / rank | received / rank | before: received / rank | "
        "collectives | analysis | its input | peak RSS growth |"
    )
    lines = [head, "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        before = before_bytes(r["world"], r["tensors"])["received"]
        lines.append(
            f"| {r['world']:,} | {r['tensors']:,} | {r['how']} | {_kb(r['sent'])} | {_kb(r['received'])} | "
            f"{_kb(before)} | {r['collectives']} | {r['analysis_s'] * 1e3:.0f} ms | "
            f"{r['summary_mb']:.1f} MB | "
            + (f"{r['analysis_peak_mb']:.0f} MB |" if r["analysis_peak_mb"] >= 1 else "< 1 MB |")
        )
    if guards:
        names = list(guards[0]["figures"])
        lines += [
            "",
            "| ranks | tensors | " + " | ".join(f"{n}: received / rank" for n in names) + " |",
            "|---:|---:|" + "---:|" * len(names),
        ]
        for g in guards:
            lines.append(
                f"| {g['world']} | {g['tensors']} | "
                + " | ".join(f"{g['figures'][n]['received']:,} B" for n in names)
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="300 tensors and world sizes 2 and 64 only")
    p.add_argument(
        "--sharded-quick",
        action="store_true",
        help="the FSDP2 rows at 302 tensors only (3,002 tensors on 4 and 8 real ranks take many minutes on 2 cores)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)  # like each rank; intra-op threads only fight the other processes on a small machine
    tensors = (300,) if args.quick else TENSORS
    worlds = (2, 64) if args.quick else WORLDS
    rows, checks = [], []
    for params in tensors:
        for world in worlds:
            if world <= REAL_MAX:
                real = real_row(world, params)
                model = model_row(world, params)
                assert (real["sent"], real["rounds"]) == (model["sent"], model["rounds"]), (real, model)
                checks.append(
                    f"W={world}, {params} tensors: the model moved the same bytes in the same "
                    f"{real['collectives']} collectives as the gloo group"
                )
                rows.append(real)
            else:
                rows.append(model_row(world, params))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "rounds"}), flush=True)
        real = real_row(REAL_MAX, params)
        model = model_row(REAL_MAX, params)
        assert (real["sent"], real["rounds"]) == (model["sent"], model["rounds"]), (real, model)
        checks.append(
            f"W={REAL_MAX}, {params} tensors: the model moved the same bytes in the same "
            f"{real['collectives']} collectives as the gloo group"
        )
    guards = guard_rows((2, 4, 8), depth=75)
    sys.path.insert(0, str(Path(__file__).parent))
    from sharded_scale import markdown as sharded_markdown
    from sharded_scale import measure as sharded_measure

    sharded, sharded_checks = sharded_measure(args.quick or args.sharded_quick)
    checks += sharded_checks
    print(markdown(rows, guards))
    print(sharded_markdown(sharded))
    print("\n".join(checks))
    if args.json:
        out = {"rows": rows, "guard": guards, "sharded": sharded, "checks": checks}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
