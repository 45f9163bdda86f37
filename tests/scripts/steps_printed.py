"""Prints each step it starts and trains slowly (0.3 s a step) for a long time: the signal tests interrupt it."""

from __future__ import annotations

import time

from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if rank == 0:
        print(f"step {step}", flush=True)
    time.sleep(0.3)


if __name__ == "__main__":
    train(setup(), steps=10_000, before_step=before_step)
