"""Rank 1 raises an ordinary error at step 3; rank 0 then waits for it inside DDP's all-reduce."""

from __future__ import annotations

from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if rank == 1 and step == 3:
        raise ValueError("corrupt sample 1234 in shard 1")


if __name__ == "__main__":
    train(setup(), before_step=before_step)
