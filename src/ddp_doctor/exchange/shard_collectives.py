"""The float32 reference of FSDP2's low-precision reduce-scatter, measured while the job runs (the sharded report's
own rounds are `sharded_protocol.py`'s)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_in_float32"]


def reduce_scatter_in_float32(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: dist.ProcessGroup
) -> torch.Tensor:
    """The reduce-scatter FSDP2 just made of `input` (into `output`), made again in float32: the reference its
    low-precision result is measured against. Collective on `group`, issued right after FSDP2's own on every
    rank (the same shapes, since FSDP2's are)."""
    reference = torch.empty(output.shape, dtype=torch.float32, device=output.device)
    dist.reduce_scatter_tensor(reference, input.float(), op=op, group=group)
    return reference
