"""gather: the only module that talks to other ranks.

`exchange` is what the check uses: the reductions of `ddp_doctor.exchange.protocol`, whose per-rank volume does
not grow with the world size. `gather` is the full exchange (every rank's whole record to every rank, O(world size)
per rank), kept for tools and tests that want the records themselves on small groups.

For `gather`, every rank runs the same sequence with the same shapes, whatever it observed: an arrival check on the process
group's store (so a rank that never calls `report()` is named instead of hanging the others), one all_gather of a
fixed float64 header (`_collective.agree`: the layout must match, the lengths may differ), then one all_gather of
the padded numeric record and one of the padded JSON metadata. The padded lengths come from the header, which
every rank holds identically after the first collective.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import zlib

import torch
import torch.distributed as dist

from ddp_doctor._collective import agree, global_ranks
from ddp_doctor._collective import arrive as group_arrive
from ddp_doctor.exchange import Reply, Summary, Volume, protocol
from ddp_doctor.records import ModelInfo, RankRecord

__all__ = ["arrive", "exchange", "gather"]

logger = logging.getLogger(__name__)

_calls = itertools.count()
_REPORT_FIX = "call it on every rank, after the observe() block."


def _layout_hash(info: ModelInfo) -> int:
    text = "|".join(f"{n}:{tuple(s)}" for n, s in zip(info.param_names, info.param_shapes))
    return zlib.crc32(text.encode())


def arrive(tag: str, timeout: float) -> None:
    """Wait until every rank of the world reached the same `tag`, or raise `ReportTimeoutError` naming the ranks
    that did not (`ddp_doctor._collective.arrive` over the default group, worded for `report()`)."""
    group_arrive(tag, group=None, timeout=timeout, call="report()", fix=_REPORT_FIX)


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu() for o in out]


def exchange(record: RankRecord, info: ModelInfo, *, timeout: float, tag: str, device: torch.device,
             group: dist.ProcessGroup | None = None) -> Summary:
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
    group_arrive(f"{tag}/{next(_calls)}", group=group, timeout=timeout, call="report()",
                 fix=_REPORT_FIX if whole else
                 "call it on every rank of the DDP model's process group, after the observe() block.")
    n_params, n_buffers = record.used.shape[1], record.buffer_fp.shape[1]
    agree([_layout_hash(info), n_buffers, n_params], group=group, device=device,
          what="the ranks observed different models", cause="parameter names or shapes",
          describe=lambda h: f"{int(h[2])} params, {int(h[1])} buffers",
          fix="Every rank must build the same model, in the same order, before wrapping it in DDP.")
    world = dist.get_world_size(group)
    volume = Volume()
    steps = protocol(record, info, rank=dist.get_rank(group), world=world)
    request = next(steps)
    while True:
        op, local = request
        volume.add(op, local, world)
        buf = local.to(device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
        try:
            request = steps.send(Reply(buf.cpu()))
        except StopIteration as stop:
            summary: Summary = stop.value
            break
    summary.volume = volume
    if not whole:  # a copy: the caller's ModelInfo may be the summary's
        ranks = global_ranks(group, range(world))
        summary.info = dataclasses.replace(summary.info, group_ranks=ranks,
                                           ddp_config={**summary.info.ddp_config, "process_group_ranks": ranks})
    return summary


def gather(record: RankRecord, info: ModelInfo, *, timeout: float, tag: str, device: torch.device,
           group: dist.ProcessGroup | None = None) -> tuple[ModelInfo, list[RankRecord]]:
    """Exchange every rank's record within `group` (the DDP model's own process group; None: the world).
    Collective over that group: ranks of other groups (other data-parallel replicas of a hybrid job) may hold other
    models and take no part.

    Returns:
        The group's first rank's `ModelInfo` (with `group_ranks`, the members' global ranks, for a subgroup) and
        every member's `RankRecord` (`rank` is the rank within the group), in group order; identical on every
        member.

    Raises:
        ReportTimeoutError: a rank did not arrive within `timeout` seconds.
        RankMismatchError: the ranks observed different parameter lists (raised on every rank).
    """
    whole = group is None or group is dist.group.WORLD
    group_arrive(f"{tag}/{next(_calls)}", group=group, timeout=timeout, call="report()",
                 fix=_REPORT_FIX if whole else
                 "call it on every rank of the DDP model's process group, after the observe() block.")
    meta = json.dumps({"record": record.meta(), "info": info.to_dict()}).encode()
    n_params, n_buffers = record.used.shape[1], record.buffer_fp.shape[1]
    # Every rank needs every rank's step count and metadata length (carried), so this is one all_gather.
    agreed = agree([_layout_hash(info), n_buffers], carry=[n_params, record.steps, len(meta)], group=group,
                   device=device, what="the ranks observed different models", cause="parameter names or shapes",
                   describe=lambda h: f"{int(h[2])} params, {int(h[1])} buffers",
                   fix="Every rank must build the same model, in the same order, before wrapping it in DDP.")
    assert agreed is not None  # with carry= and no failure, agree() always returns the headers
    headers = [[int(v) for v in row[2:]] for row in agreed.rows]       # [n_params, steps, meta_bytes]

    pad_steps = max(h[1] for h in headers)
    pad_meta = max(h[2] for h in headers)
    flat = _all_gather(record.pack(pad_steps).to(device), group)
    meta_tensor = torch.zeros(pad_meta, dtype=torch.uint8)
    meta_tensor[: len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    metas = _all_gather(meta_tensor.to(device), group)

    records = []
    infos = []
    for r, (h, f, m) in enumerate(zip(headers, flat, metas)):
        decoded = json.loads(bytes(m[: h[2]].tolist()).decode())
        infos.append(ModelInfo.from_dict(decoded["info"]))
        records.append(RankRecord.unpack(f, rank=r, steps=h[1], pad_steps=pad_steps, n_params=n_params,
                                         n_buffers=n_buffers, meta=decoded["record"]))
    info0 = infos[0]
    if group is not None and group is not dist.group.WORLD:
        info0.group_ranks = global_ranks(group, range(len(headers)))
        info0.ddp_config = {**info0.ddp_config, "process_group_ranks": info0.group_ranks}
    return info0, records
