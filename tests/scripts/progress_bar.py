"""Prints a progress bar with carriage returns and no final newline, like tqdm does, while it trains."""

from __future__ import annotations

import sys

from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if rank == 0:
        sys.stdout.write(f"\rtraining {'#' * step:<20} {step}/20\x1b[K")
        sys.stdout.flush()


if __name__ == "__main__":
    train(setup(), before_step=before_step)
