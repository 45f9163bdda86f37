"""The collectives of a sharded model's report (FSDP2, `replicate`) beyond the element-wise `minmax` of its slots
and fingerprints: who saved a file of shards and what the first saver wrote, and the float32 reference of FSDP2's
low-precision reduce-scatter. Every rank issues each one alike: the decision to issue it depends only on earlier
collectives' results, never on local data."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddp_doctor.exchange.oddranks import odd_ranks

__all__ = ["count_and_first", "held_apart", "reduce_scatter_in_float32"]


def count_and_first(flag: bool, shown: Any, first: int, device: torch.device) -> tuple[int, Any]:
    """How many ranks set `flag`, and `shown` as rank `first` holds it (a small picklable value: a site, a path,
    a shape). Collective on the default group: one all_reduce of one number and one broadcast from one rank, so
    the volume does not grow with the world size."""
    count = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(count)
    box = [shown]
    dist.broadcast_object_list(box, src=first)
    return int(count.item()), box[0]


def held_apart(digest: float, held: Any, device: torch.device) -> dict[str, Any]:
    """Once a min/max showed that the ranks' `digest`s differ: the reference copy (the most common digest, the
    lowest rank on a tie), the ranks holding another one (`oddranks.odd_ranks`: the lowest few named, the rest
    counted), and `held` (a small picklable value: a text, an entry) as the reference rank and the first other rank
    hold it. Collective on the default group; its volume does not grow with the world size.

    Returns:
        `reference` (its rank), `ranks` (the named other ranks), `more` (how many others are not named), `held`
        ({rank: value} for the reference rank and the first other rank).
    """
    [odd] = odd_ranks(torch.tensor([[digest]], dtype=torch.float64), group=None, device=device)
    shown = {}
    for rank in (odd.reference, odd.odd.examples[0]):
        box = [held]
        dist.broadcast_object_list(box, src=rank)
        shown[rank] = box[0]
    return {"reference": odd.reference, "ranks": odd.odd.examples, "more": odd.odd.more, "held": shown}


def reduce_scatter_in_float32(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: dist.ProcessGroup
) -> torch.Tensor:
    """The reduce-scatter FSDP2 just made of `input` (into `output`), made again in float32: the reference its
    low-precision result is measured against. Collective on `group`, issued right after FSDP2's own on every
    rank (the same shapes, since FSDP2's are)."""
    reference = torch.empty(output.shape, dtype=torch.float32, device=output.device)
    dist.reduce_scatter_tensor(reference, input.float(), op=op, group=group)
    return reference
