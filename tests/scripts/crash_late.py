"""Trains cleanly, then both ranks raise at step 6: after 4 observed steps, during bench's timed steps."""

from __future__ import annotations

from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if step == 6:
        raise RuntimeError("loss is NaN at step 6")


if __name__ == "__main__":
    train(setup(), before_step=before_step)
