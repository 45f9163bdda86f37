"""Rank 1 stops making progress at step 2 (a stuck data source); rank 0 waits for it in DDP's all-reduce."""

from __future__ import annotations

import time

from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if rank == 1 and step == 2:
        while True:
            time.sleep(1.0)


if __name__ == "__main__":
    train(setup(), before_step=before_step)
