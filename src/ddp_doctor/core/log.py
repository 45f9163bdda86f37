"""Logging helpers: library code logs through `logging.getLogger(__name__)`; only the CLI configures handlers.
These add what logging lacks: the rank, rank-zero only, and once per process."""

from __future__ import annotations

import functools
import logging

import torch.distributed as dist

__all__ = ["is_rank_zero", "log_once", "rank"]


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_rank_zero() -> bool:
    return rank() == 0


@functools.cache
def log_once(logger: logging.Logger, level: int, message: str) -> None:
    """Log `message` once per process (the cache key is the message itself)."""
    logger.log(level, message)
