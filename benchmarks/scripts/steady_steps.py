"""A DDP job of STEPS steps (default 400) of an MLP (70 blocks of width 128, 280 parameter tensors), with each rank
writing to STEP_TIMES_DIR/rank{R}.json the wall time of every step after the first FROM (default 100): the steady
steps that `ddp-doctor watch` only watches. Under `watch` it also writes what ddp-doctor spent in the rank over those
steps (`account`): the CPU time of its watchdog thread, and the time its optimizer-step hooks take per step (each
called 1,000 times after the last step).

    torchrun --nproc-per-node 2 benchmarks/scripts/steady_steps.py
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps, first = int(os.environ.get("STEPS", "400")), int(os.environ.get("FROM", "100"))
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(70):
        layers += [nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU()]
    model = DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 128)
    times = []
    watchdog = next((t for t in threading.enumerate() if t.name == "ddp-doctor-watchdog"), None)
    for step in range(steps):
        if step == first:
            cpu0, wall0, began = _cpu(watchdog), time.perf_counter(), time.time()
        start = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= first:
            times.append(time.perf_counter() - start)
    out = {"steps": times}
    if watchdog is not None:
        out["account"] = {
            "window_s": time.perf_counter() - wall0,
            "window": [began, time.time()],
            "watchdog_cpu_s": _cpu(watchdog) - cpu0,
            "hooks_us_per_step": _hooks_us(opt),
        }
    Path(os.environ["STEP_TIMES_DIR"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _cpu(thread: threading.Thread | None) -> float:
    """The CPU seconds `thread` has used (0 without one)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) if thread is not None else 0.0


def _hooks_us(opt: torch.optim.Optimizer, calls: int = 1000) -> float:
    """Microseconds that ddp-doctor's optimizer-step hooks (torch's global ones, and this optimizer's) take per step."""
    from torch.optim import optimizer

    hooks = [
        h
        for d in (
            optimizer._global_optimizer_pre_hooks,
            optimizer._global_optimizer_post_hooks,
            opt._optimizer_step_pre_hooks,
            opt._optimizer_step_post_hooks,
        )
        for h in d.values()
        if "ddp_doctor" in f"{getattr(h, '__module__', '')} {getattr(getattr(h, 'fn', None), '__module__', '')}"
    ]
    start = time.perf_counter()
    for _ in range(calls):
        for h in hooks:
            h(opt, (), {})
    return (time.perf_counter() - start) / calls * 1e6


if __name__ == "__main__":
    main()
