"""A small multi-rank test harness: real gloo process groups, no mocks.

Ranks start from a forkserver that has already imported torch and what DDP's constructor imports (torch._dynamo, about
1 s of CPU per rank otherwise), rendezvous through a FileStore in the test's tmp_path (no ports), and run under a process-group timeout.
Every rank's traceback is collected; ranks that only saw their peer disappear are listed last. Stragglers are
killed, so a hanging rank fails the test instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "ddp_doctor"])

_PEER_NOISE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "connection closed")


class RankFailure(AssertionError):
    """One or more ranks raised or did not finish."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    store_path: str,
    pg_timeout: float,
    conn: Any,
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), **env}
    )
    torch.set_num_threads(1)
    try:
        # DDP_DOCTOR_TEST_DEVICE=cuda puts each rank on a GPU (the GPU-only tests set it); the backend is gloo
        # unless DDP_DOCTOR_TEST_BACKEND says otherwise (nccl).
        if os.environ.get("DDP_DOCTOR_TEST_DEVICE") == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            os.environ.get("DDP_DOCTOR_TEST_BACKEND", "gloo"),
            store=dist.FileStore(store_path, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        # Every rank's gloo mesh is connected before `fn` runs: a rank that returns at once (a test's "rank that never
        # comes") would otherwise close its sockets while a slower peer is still in connectFullMesh, and that peer's
        # init fails with "Connection closed by peer" (seen once in CI, 8 ranks on 2 busy cores).
        dist.barrier()
        result = fn(rank, world, *args)
        conn.send(("ok", result))
    except BaseException:  # noqa: BLE001  (every failure of the rank goes back to the test)
        conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_ranks(
    fn: Callable[..., Any],
    tmp_path: Path,
    *,
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    pg_timeout: float = 20.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks and return each rank's result, in rank order.

    `fn` must be importable (a module-level function). Raises `RankFailure` with every rank's traceback when any
    rank raises, or when a rank is still running after `timeout` seconds (it is then killed).
    """
    store = tmp_path / f"store-{time.monotonic_ns()}"
    pipes, procs = [], []
    for rank in range(world_size):
        parent, child = _CTX.Pipe(duplex=False)
        p = _CTX.Process(
            target=_child,
            args=(fn, rank, world_size, str(store), pg_timeout, child, args, env or {}),
            name=f"rank{rank}",
        )
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)

    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        for rank, conn in enumerate(pipes):
            if rank in outcomes:
                continue
            if conn.poll(0.02):
                try:
                    outcomes[rank] = conn.recv()
                except EOFError:
                    outcomes[rank] = (
                        "error",
                        (f"rank {rank} exited with code {procs[rank].exitcode} without a result"),
                    )
            elif not procs[rank].is_alive() and not conn.poll(0):
                outcomes[rank] = ("error", f"rank {rank} died with exit code {procs[rank].exitcode}")
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)

    hung = [r for r in range(world_size) if r not in outcomes]
    errors = {r: o[1] for r, o in outcomes.items() if o[0] == "error"}
    if hung or errors:
        order = sorted(errors, key=lambda r: (any(n in errors[r] for n in _PEER_NOISE), r))
        parts = [f"rank {r} did not finish within {timeout:g} s and was killed" for r in hung]
        parts += [f"--- rank {r} ---\n{errors[r]}" for r in order]
        raise RankFailure("\n".join(parts))
    return [outcomes[r][1] for r in range(world_size)]
