"""Trains slowly (0.5 s a step) for a long time; with --slow-start it first sleeps 30 s before importing torch,
like a script that loads data. The fault tests interrupt it."""

from __future__ import annotations

import sys
import time

if "--slow-start" in sys.argv:
    time.sleep(30)

from _train import setup, train


def before_step(rank: int, step: int) -> None:
    time.sleep(0.5)


if __name__ == "__main__":
    train(setup(), steps=10_000, before_step=before_step)
