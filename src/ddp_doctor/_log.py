"""Logging helpers: library code logs, only the CLI configures handlers."""

from __future__ import annotations

import functools
import logging

import torch.distributed as dist

__all__ = ["get_logger", "is_rank_zero", "log_once", "rank"]


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_rank_zero() -> bool:
    return rank() == 0


@functools.cache
def log_once(logger: logging.Logger, level: int, message: str) -> None:
    """Log `message` once per process (the cache key is the message itself)."""
    logger.log(level, message)
