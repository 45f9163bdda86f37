"""A small DDP job for `ddp-doctor watch`: STEPS optimizer steps (default 30), then each rank prints a checksum of its
weights; an atexit handler and a non-daemon thread each print a line at the end. STEP_S: a sleep after each step. STALL_RANK / STALL_STEP make one
rank, after that step, either spin in a Python loop (STALL=loop, at most STALL_S seconds), sleep (STALL=sleep), leave
the loop and exit (STALL=exit) or kill itself with SIGKILL (STALL=kill) while the others go on into DDP's next
gradient all-reduce; STALL=loader draws the batches from a DataLoader with one worker process, whose item for that
step sleeps STALL_S seconds on that rank. DRIFT_RANK / DRIFT_STEP: after that step, that rank alone adds 0.01 to the
first layer's bias, outside DDP's gradient sync (the replicas then train apart, silently). SLOW_FROM / SLOW_S: the
batches come from a DataLoader without workers whose items from that step on take SLOW_S seconds to read, on every
rank (a job that becomes input-bound past its first steps), or on rank SLOW_RANK alone (a rank whose reads become
slow: the others wait for it in DDP's all-reduce). WORK_RANKS / WORK_FROM / WORK_S: from that step on, those ranks (comma-separated)
spin WORK_S seconds between the forward and the backward (a slower device, or work of their own in the loss): the
others wait for them in DDP's all-reduce. After `destroy_process_group()` each rank prints a line; TEARDOWN_ABORT_RANK:
that rank then aborts (SIGABRT, as gloo's teardown can), with no collective left to break. FR_DUMP_DIR: each rank
writes its Flight Recorder dump there when a collective fails or torchrun stops it (`_dump_flight_recorder`).

    GROUP_TIMEOUT_S=20 torchrun --nproc-per-node 2 tests/scripts/watch_job.py
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class _Batches(torch.utils.data.Dataset):
    """Step i's batch; item `stall_at` takes `seconds` in the DataLoader's worker."""

    def __init__(
        self, rank: int, steps: int, stall_at: int, seconds: float, slow_from: int = -1, slow_s: float = 0.0
    ) -> None:
        self.rank, self.steps, self.stall_at, self.seconds = rank, steps, stall_at, seconds
        self.slow_from, self.slow_s = slow_from, slow_s

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.stall_at:
            time.sleep(self.seconds)
        if 0 <= self.slow_from <= i:
            time.sleep(self.slow_s)
        gen = torch.Generator().manual_seed(1000 * self.rank + i)
        return torch.randn(4, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)


def _stall(kind: str, seconds: float) -> None:
    until = time.monotonic() + seconds
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "exit":
        sys.exit(0)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "loop":
        while time.monotonic() < until: pass  # noqa: E701  # fmt: skip


def main() -> None:
    timeout = float(os.environ.get("GROUP_TIMEOUT_S", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    steps = int(os.environ.get("STEPS", "30"))
    stall_rank, stall_step = int(os.environ.get("STALL_RANK", "-1")), int(os.environ.get("STALL_STEP", "-1"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    atexit.register(lambda: print(f"rank {rank} atexit ran", flush=True))
    stall, seconds = os.environ.get("STALL", "loop"), float(os.environ.get("STALL_S", "120"))
    slow_from = int(os.environ.get("SLOW_FROM", "-1"))
    if stall == "loader":
        at = stall_step if rank == stall_rank else -1
        batches = iter(torch.utils.data.DataLoader(_Batches(rank, steps, at, seconds), batch_size=None, num_workers=1))
    elif slow_from >= 0:
        slow_rank = int(os.environ.get("SLOW_RANK", "-1"))  # -1: every rank
        slow_s = float(os.environ.get("SLOW_S", "0.05")) if slow_rank in (-1, rank) else 0.0
        slow = _Batches(rank, steps, -1, 0.0, slow_from, slow_s)
        batches = iter(torch.utils.data.DataLoader(slow, batch_size=None))
    for step in range(steps):
        if stall == "loader" or slow_from >= 0:
            x, y = next(batches)
        else:
            x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        if str(rank) in os.environ.get("WORK_RANKS", "").split(",") and step >= int(os.environ.get("WORK_FROM", "0")):
            _stall("loop", float(os.environ.get("WORK_S", "0.04")))
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(float(os.environ.get("STEP_S", "0")))
        if rank == stall_rank and step + 1 == stall_step:
            _stall(stall, seconds)
        if rank == int(os.environ.get("DRIFT_RANK", "-1")) and step + 1 == int(os.environ.get("DRIFT_STEP", "-1")):
            with torch.no_grad():
                model.module[0].bias.add_(0.01)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {rank} trained {steps} steps, checksum {checksum:.12f}", flush=True)
    threading.Thread(target=lambda: (time.sleep(0.2), print(f"rank {rank} thread joined", flush=True))).start()
    dist.destroy_process_group()
    print(f"rank {rank} ran past its process group", flush=True)
    if rank == int(os.environ.get("TEARDOWN_ABORT_RANK", "-1")):
        time.sleep(0.5)  # the other ranks end first, as when gloo aborts one process at its teardown
        os.abort()


def _dump_flight_recorder(*_: object) -> None:
    """With FR_DUMP_DIR set (and TORCH_FR_BUFFER_SIZE), write PyTorch's Flight Recorder dump to FR_DUMP_DIR/rank_R
    when a collective fails or torchrun stops the rank (SIGTERM), as NCCL's watchdog dumps every rank on a timeout
    (gloo writes none itself)."""
    folder = os.environ.get("FR_DUMP_DIR")
    if folder and dist.is_initialized():
        from torch._C._distributed_c10d import _dump_fr_trace

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank_{dist.get_rank()}"), "wb") as f:
            f.write(_dump_fr_trace(True, True, False))
    if _:  # the signal
        sys.exit(1)


if __name__ == "__main__":
    if os.environ.get("FR_DUMP_DIR"):
        signal.signal(signal.SIGTERM, _dump_flight_recorder)
        try:
            main()
        except RuntimeError:
            _dump_flight_recorder()
            raise
    else:
        main()
