"""Round A of the check's exchange: the common and padded step counts, and group rank 0's `ModelInfo` when the
ranks' differ. One MAX, then one SUM only when the ModelInfos differ, and a SUM and a MAX of one row per parameter
only when the ranks handed DDP different trainable sets."""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from ddp_doctor.core.records import ModelInfo, RankRecord
from ddp_doctor.exchange.packing import MaxRound, Op, Reply, differs, from_words, text_digest, to_words

__all__ = ["Agreed", "agree_steps", "leading_complete"]


@dataclass(frozen=True, slots=True)
class Agreed:
    """What round A settles: the steps every later round is shaped by, and the `ModelInfo` that speaks for the
    group."""

    info: ModelInfo
    """This rank's, or group rank 0's when the ranks' differ."""
    steps: int
    """Steps every rank completed (the minimum over the ranks of their leading complete steps): S."""
    pad_steps: int
    """The most steps any rank recorded (the padded shapes)."""
    lead: int
    """This rank's own leading complete steps (local: the step a crash interrupted is `lead`)."""
    wrap_trainable: torch.Tensor | None = None
    """int64[P, 3] when the ranks handed DDP different trainable sets (None: the same): per parameter, how many
    ranks had it trainable at the wrap, and the lowest rank that had it trainable and that had it not (-1: none)."""


def leading_complete(record: RankRecord) -> int:
    complete = record.counter("complete").bool().tolist()
    return next((i for i, c in enumerate(complete) if not c), len(complete))


_last_info: list[Any] = [None, b"", 0]


def info_json(info: ModelInfo) -> tuple[bytes, int]:
    """The ModelInfo as JSON and its digest. The in-process model hands one ModelInfo to every rank: the last one
    is remembered (the ranks of a real group each compute theirs once)."""
    if _last_info[0] is not info:
        data = json.dumps(info.to_dict(), sort_keys=True).encode()
        _last_info[:] = [info, data, text_digest(data)]
    return _last_info[1], _last_info[2]


def agree_steps(record: RankRecord, info: ModelInfo, *, rank: int) -> Generator[Op, Reply, Agreed]:
    """Puts: MAX pairs of (recorded steps, leading complete steps) and of the ModelInfo's digest, and group rank
    0's JSON length in a slot; then, only when the digests differ, rank 0's JSON in a SUM of words."""
    lead = leading_complete(record)
    info_bytes, info_digest = info_json(info)
    a = MaxRound()
    a.pair("steps", torch.tensor([record.steps, lead]))
    a.pair("info", torch.tensor([info_digest]))
    trainable = torch.tensor(info.trainable_at_wrap, dtype=torch.bool)
    a.pair("trainable", torch.tensor([text_digest(bytes(trainable.to(torch.uint8).tolist()))]))
    a.slot("info_len", torch.tensor([len(info_bytes)]), rank == 0)
    ra = a.read((yield ("max", a.tensor())))
    pad_steps, s = int(ra["steps"][0][0]), int(ra["steps"][1][1])
    if bool(differs(ra["info"]).any()):
        # Group rank 0's ModelInfo speaks for the group (names and shapes already agree: they are in the layout
        # hash, checked before); it travels once, from rank 0 only.
        n = int(ra["info_len"][0])
        words = to_words(info_bytes if rank == 0 else b"", -(-n // 8))
        got = yield ("sum", words if rank == 0 else torch.zeros_like(words))
        info = ModelInfo.from_dict(json.loads(from_words(got.tensor, n).decode()))
    wrap_trainable = None
    if bool(differs(ra["trainable"]).any()):
        # The ranks handed DDP different trainable parameters of the same names and shapes (its constructor checks
        # the shapes only): how many had each trainable, and the lowest rank on each side.
        big = 1 << 30
        counts = yield ("sum", trainable.long())
        sides = [[big - rank if t else -1, -1 if t else big - rank] for t in trainable.tolist()]
        lowest = yield ("max", torch.tensor(sides, dtype=torch.long).reshape(-1, 2))
        low = torch.where(lowest.tensor >= 0, big - lowest.tensor, torch.full_like(lowest.tensor, -1))
        wrap_trainable = torch.cat([counts.tensor.reshape(-1, 1), low], dim=1)
    return Agreed(info=info, steps=s, pad_steps=pad_steps, lead=lead, wrap_trainable=wrap_trainable)
