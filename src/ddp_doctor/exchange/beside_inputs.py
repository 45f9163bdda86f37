"""Whether the ranks of each group beside a sharded model's data-parallel mesh (a tensor-parallel group:
`core/beside.py`) fed the same inputs to the observed steps' training forwards. Fixed shape, whatever the world.

Each rank puts its step's inputs digest `h` (two 20-bit hashes of the inputs' fingerprint) times a coefficient: the
group's lowest rank `t - 1`, every other member `-1` (`t` the group's size). The coefficients of a group add up to
0, so one SUM over every rank is 0 exactly (integers below 2**53) when every group's members hold one digest, and
not 0 once some group's members differ (but for a cancellation of two 20-bit hashes together). Then one SUM of 64
slots, the group's data-parallel index modulo 64, says which groups: by name up to 64 groups; beyond, which slots
(each the groups whose index is the same modulo 64), no group named.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Generator
from typing import Any

import torch

from ddp_doctor.core.beside import BesideGroup
from ddp_doctor.core.sharded_run import INPUT_STEPS
from ddp_doctor.exchange.packing import Op, Reply

__all__ = ["SLOTS_OF_GROUPS", "beside_inputs_rounds"]

SLOTS_OF_GROUPS = 64
"""The second round's slots: a group's data-parallel index modulo this."""
_NAMED = 4
"""Groups named at most."""


def _hashes(fingerprint: torch.Tensor) -> list[float]:
    data = struct.pack("<2d", *fingerprint.tolist())
    return [float(zlib.crc32(data) & 0xFFFFF), float(zlib.adler32(data) & 0xFFFFF)]


def beside_inputs_rounds(
    steps: torch.Tensor, beside: BesideGroup | None, seen: list[int], groups: int
) -> Generator[Op, Reply, dict[str, Any]]:
    """`ShardedRun.beside_*` from this rank's per-step table (`ShardedRecord.steps`: the inputs' fingerprint in
    columns 0 and 1) and its group. `seen`: the steps whose inputs every rank measured; `groups`: how many groups
    every rank found (0 where some rank found none or another count: then no round runs)."""
    if not groups or not seen or beside is None:
        return {"beside_compared": [], "beside_apart": None, "beside_groups": 0, "beside_dims": []}
    members = beside.members[beside.index]
    weight = float(len(members) - 1) if beside.rank == members[0] else -1.0
    table = torch.zeros(INPUT_STEPS, 2, dtype=torch.float64)
    for k in seen:
        table[k] = weight * torch.tensor(_hashes(steps[k, 0:2]), dtype=torch.float64)
    sums = (yield ("sum", table)).tensor
    bad = [k for k in seen if bool((sums[k] != 0).any())]
    if not bad:
        return {"beside_compared": seen, "beside_apart": None, "beside_groups": groups, "beside_dims": beside.dims}
    slots = torch.zeros(SLOTS_OF_GROUPS, 2, dtype=torch.float64)
    slots[beside.index % SLOTS_OF_GROUPS] = table[bad[0]]
    got = (yield ("sum", slots)).tensor
    odd = [s for s in range(SLOTS_OF_GROUPS) if bool((got[s] != 0).any())]
    exact = groups <= SLOTS_OF_GROUPS
    return {
        "beside_compared": seen,
        "beside_groups": groups,
        "beside_dims": beside.dims,
        "beside_apart": {
            "step": bad[0],
            "steps": bad,
            "groups": [beside.members[s] for s in odd[:_NAMED]] if exact else [],
            "slots": odd[:_NAMED],
            "count": len(odd),
            "exact": exact,
            "dims": beside.dims,
        },
    }
