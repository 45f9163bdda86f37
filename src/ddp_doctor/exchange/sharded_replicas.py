"""Do the replicas of an FSDP2-built model hold the same weights? A round of the sharded exchange
(`sharded_protocol.py`) for a model whose parameters are replicated: FSDP2's `replicate` (every rank holds the whole
of each parameter) and HSDP (`fully_shard` on a 2-D mesh: the ranks along the replicate dimension hold the same
shard). Neither broadcasts rank 0's weights when it wraps the model, as DDP does, and nothing compares them after.

Each rank puts the fingerprints of its local tensors, after the first observed step and after the last, in its
replica row (`ShardedModel.replica_row`: the ranks holding the same shard share a row), beside one sum of them per
observed step. One MAX compares each row's sums (the step at which copies part is the first whose sums differ);
only where they differ, one MAX compares every parameter, then the ranks that differ are named (the most common
copy is the reference under `replicate`; the lowest rank of the row holds it under HSDP, where a row often has two
ranks). The shapes depend on the rows and parameters every rank counted alike, and on values already reduced.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from ddp_doctor.exchange.oddranks import name_flagged_rounds, odd_ranks_rounds, pick_rounds
from ddp_doctor.exchange.packing import Op, Reply

__all__ = ["MAX_REPLICA_ROWS", "replicas_rounds"]

MAX_REPLICA_ROWS = 64
"""The most replica rows compared (an HSDP mesh's shard dimension): the round's volume is rows x parameters."""
_FAR = 1e300
"""Below every fingerprint: a row a rank does not hold takes no part in the MAX."""


def _masked_minmax(
    values: torch.Tensor, row: int, rows: int
) -> Generator[Op, Reply, tuple[torch.Tensor, torch.Tensor]]:
    """Per row, the element-wise maximum and minimum of `values` over the ranks of that row. One MAX."""
    table = torch.full((2, rows, *values.shape), -_FAR, dtype=torch.float64)
    table[0, row], table[1, row] = values, -values
    got = (yield ("max", table.reshape(-1))).tensor.reshape(2, rows, *values.shape)
    return got[0], -got[1]


def replicas_rounds(
    fingerprints: torch.Tensor | None,
    steps: torch.Tensor | None,
    row: int,
    top: dict[str, float],
    low: dict[str, float],
    *,
    rank: int,
    world: int,
) -> Generator[Op, Reply, dict[str, Any]]:
    """`ShardedRun`'s `replica*` fields: how many parameters were compared, and, where replicas differ, where first.

    Args:
        fingerprints: float64[P, 4], this rank's local tensors' fingerprints after the first observed step and after
            the last (zeros for a parameter that is not replicated); None where the rank compares none.
        steps: float64[S, 2], per observed step the sum of those fingerprints after its optimizer step and 1 where
            it was measured (`ShardedRecord.replica_steps`); S is `INPUT_STEPS` on every rank.
        row: this rank's replica row.
        top, low: the reduced slots; `replica_rows` (0 where none) and `params` must agree on every rank.
    """
    rows, params = int(top["replica_rows"]), int(top["params"])
    if not 0 < rows <= MAX_REPLICA_ROWS or rows != low["replica_rows"] or params != low["params"]:
        return {"replica_rows": rows if rows == low["replica_rows"] else 0, "replicas_compared": 0}
    assert fingerprints is not None and steps is not None
    compared = {"replica_rows": rows, "replicas_compared": params}
    sums = torch.cat([fingerprints.sum(0), steps.flatten()])
    high, lowest = yield from _masked_minmax(sums, row, rows)
    if bool((high == lowest).all()):
        return compared
    per_step = (high[:, 4:].reshape(rows, -1, 2), lowest[:, 4:].reshape(rows, -1, 2))
    high, lowest = yield from _masked_minmax(fingerprints, row, rows)  # [rows, P, 4]
    apart_first = (high[..., :2] != lowest[..., :2]).any(-1)
    at_first = bool(apart_first.any())
    apart = apart_first if at_first else (high[..., 2:] != lowest[..., 2:]).any(-1)
    if not bool(apart.any()):  # the sums differed by rounding only: no parameter does
        return compared
    parted = int(apart.any(1).nonzero()[0])
    differ = apart[parted].nonzero().flatten().tolist()
    step_high, step_low = per_step[0][parted], per_step[1][parted]
    first_step = next(
        (k for k in range(len(step_low)) if step_low[k, 1] == 1 and step_high[k, 0] != step_low[k, 0]), None
    )
    cols = slice(0, 2) if at_first else slice(2, 4)
    copy = fingerprints[differ[0], cols].reshape(1, 2).to(torch.float64)
    if rows == 1:
        [odd] = yield from odd_ranks_rounds(copy, rank=rank, world=world)
        reference, named = odd.reference, odd.odd
    else:
        member = torch.tensor([row == parted])
        [lowest_rank] = yield from name_flagged_rounds(member, rank=rank, world=world, limit=1)
        reference = lowest_rank.examples[0]
        held = yield from pick_rounds(copy, torch.tensor([reference]), rank=rank)
        flag = torch.tensor([row == parted and bool((copy != held).any())])
        [named] = yield from name_flagged_rounds(flag, rank=rank, world=world)
    return {
        **compared,
        "replicas_apart": {
            "at_first": at_first,
            "first_step": first_step,
            "row": parted,
            "params": differ,
            "reference": reference,
            "ranks": named.examples,
            "more": named.more,
        },
    }
