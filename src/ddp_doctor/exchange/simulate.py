"""The exchange's model: every rank's `protocol` run in lockstep in one process, each collective's result computed
as the reduction computes it. The pure `analyze(info, records)` entry point and the scale benchmark use it, so they
run the same packing and the same local computations as a real process group."""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Generator, Sequence
from typing import TypeVar

import torch

from ddp_doctor.core.records import ModelInfo, RankRecord
from ddp_doctor.core.summary import Summary, Volume
from ddp_doctor.exchange import packing
from ddp_doctor.exchange.packing import Op, Reply
from ddp_doctor.exchange.protocol import protocol

__all__ = ["lockstep", "summarize"]

T = TypeVar("T")


def summarize(info: ModelInfo, records: Sequence[RankRecord], *, infos: Sequence[ModelInfo] | None = None) -> Summary:
    """Run every rank's `protocol` in lockstep in this process, each collective's result computed as the
    reduction computes it. Pure: no process group. `records[w]` is group rank w's record.

    Ranks are advanced one at a time and their buffers folded into a running SUM or MAX, so the model of W ranks
    holds one buffer, not W (the benchmark runs 1,024 ranks this way). Every collective is checked to have the same
    op and shape on every rank: the invariant that keeps the real exchange from hanging.

    Args:
        info: the model (every rank's, unless `infos` gives one per rank).
        records: one per rank, in group-rank order.
        infos: per-rank `ModelInfo`, when they differ.

    Returns:
        Group rank 0's `Summary` (every rank's is the same), with `volume` counting one rank's bytes.
    """
    # Thousands of suspended generators and their tensors make the cyclic collector rescan them all the time;
    # nothing here builds reference cycles.
    collecting = gc.isenabled()
    gc.disable()
    packing.memo = OrderedDict()
    try:
        return _run(info, records, infos)
    finally:
        packing.memo = None
        if collecting:
            gc.enable()


def _run(info: ModelInfo, records: Sequence[RankRecord], infos: Sequence[ModelInfo] | None) -> Summary:
    world = len(records)
    result, volume = lockstep(
        [protocol(r, infos[w] if infos else info, rank=w, world=world) for w, r in enumerate(records)]
    )
    result.volume = volume
    return result


def lockstep(gens: Sequence[Generator[Op, Reply, T]]) -> tuple[T, Volume]:
    """Run every rank's rounds (`gens[w]` is group rank w's) in lockstep, each collective's result computed as the
    reduction computes it, and return what rank 0's returns, with the bytes one rank sent. Every collective is
    checked to have the same op and shape on every rank, and every rank to end at the same one."""
    world = len(gens)
    volume = Volume()
    reply: Reply | None = None
    while True:
        acc: torch.Tensor | None = None
        op0: str | None = None
        ended, result = 0, None
        for w, g in enumerate(gens):
            try:
                op, t = next(g) if reply is None else g.send(reply)
            except StopIteration as stop:
                ended += 1
                if w == 0:
                    result = stop.value
                continue
            if acc is None:
                op0, acc = op, t.clone()
            else:
                assert op == op0 and t.shape == acc.shape and t.dtype == acc.dtype, (
                    f"rank {w} issued {op} {tuple(t.shape)} where rank 0 issued {op0} {tuple(acc.shape)}"
                )
                if op == "sum":
                    acc += t
                else:
                    torch.maximum(acc, t, out=acc)
        if ended:
            assert ended == world, "ranks ended the exchange at different collectives"
            return result, volume  # type: ignore[return-value]
        assert op0 is not None and acc is not None
        volume.add(op0, acc)
        reply = Reply(acc)
