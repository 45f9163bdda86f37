"""Rank 1 is killed by SIGKILL at step 3 (what the out-of-memory killer does)."""

from __future__ import annotations

import os
import signal

from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    train(setup(), before_step=before_step)
