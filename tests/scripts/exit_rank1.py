"""Rank 1 stops early at step 3 (an early-stopping flag computed from its own loss) with sys.exit(0)."""

from __future__ import annotations

import sys

from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if rank == 1 and step == 3:
        sys.exit(0)


if __name__ == "__main__":
    train(setup(), before_step=before_step)
