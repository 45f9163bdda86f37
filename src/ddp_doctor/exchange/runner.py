"""The check's only communication, `exchange`, over the DDP model's process group.

Every rank runs the same sequence, whatever it observed: an arrival check on the process group's store (so a rank
that never calls `report()` is named instead of hanging the others), one all_reduce that checks the parameter
layout (`primitives.agree`), then the rounds of `ddp_doctor.exchange.protocol`, all_reduces whose shapes depend on
the agreed sizes and on earlier results only. What a rank sends and receives does not grow with the world size.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import torch
import torch.distributed as dist

from ddp_doctor.core.records import ModelInfo, RankRecord
from ddp_doctor.core.summary import Summary, Volume
from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.primitives import agree, global_ranks
from ddp_doctor.exchange.primitives import arrive as group_arrive
from ddp_doctor.exchange.protocol import protocol

__all__ = ["arrive", "exchange"]

_calls = itertools.count()
_REPORT_FIX = "call it on every rank, after the observe() block."


def _layout_hash(info: ModelInfo) -> int:
    text = "|".join(f"{n}:{tuple(s)}" for n, s in zip(info.param_names, info.param_shapes))
    return zlib.crc32(text.encode())


def arrive(tag: str, timeout: float) -> None:
    """Wait until every rank of the world reached the same `tag`, or raise `ReportTimeoutError` naming the ranks
    that did not (`ddp_doctor.exchange.primitives.arrive` over the default group, worded for `report()`)."""
    group_arrive(tag, group=None, timeout=timeout, call="report()", fix=_REPORT_FIX)


def exchange(
    record: RankRecord,
    info: ModelInfo,
    *,
    timeout: float,
    tag: str,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> Summary:
    """Reduce every rank's record within `group` (the DDP model's own process group; None: the world) into the
    group's `Summary`. Collective over that group, with the same collectives on every member: an arrival check on
    the store, one all_reduce that checks the parameter layout, then the rounds of `ddp_doctor.exchange.protocol`
    (all_reduces whose shapes depend on the agreed sizes and on earlier results only).

    Returns:
        The `Summary`, identical on every member (ranks in it are group ranks; `info.group_ranks` maps them to
        global ranks for a subgroup). `Summary.volume` counts this rank's bytes.

    Raises:
        ReportTimeoutError: a rank did not arrive within `timeout` seconds.
        RankMismatchError: the ranks observed different parameter lists (raised on every rank).
    """
    whole = group is None or group is dist.group.WORLD
    group_arrive(
        f"{tag}/{next(_calls)}",
        group=group,
        timeout=timeout,
        call="report()",
        fix=_REPORT_FIX
        if whole
        else "call it on every rank of the DDP model's process group, after the observe() block.",
    )
    n_params, n_buffers = record.used.shape[1], record.buffer_fp.shape[1]
    agree(
        [_layout_hash(info), n_buffers, n_params],
        group=group,
        device=device,
        what="the ranks observed different models",
        cause="parameter names or shapes",
        describe=lambda h: f"{int(h[2])} params, {int(h[1])} buffers",
        fix="Every rank must build the same model, in the same order, before wrapping it in DDP.",
    )
    world = dist.get_world_size(group)
    volume = Volume()
    steps = protocol(record, info, rank=dist.get_rank(group), world=world)
    summary = drive(steps, group=group, device=device, volume=volume)
    summary.volume = volume
    if not whole:  # a copy: the caller's ModelInfo may be the summary's
        ranks = global_ranks(group, range(world))
        summary.info = dataclasses.replace(
            summary.info, group_ranks=ranks, ddp_config={**summary.info.ddp_config, "process_group_ranks": ranks}
        )
    return summary
