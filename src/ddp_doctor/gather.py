"""gather: the only module that talks to other ranks.

Every rank runs the same sequence with the same shapes, whatever it observed: an arrival check on the process
group's store (so a rank that never calls `report()` is named instead of hanging the others), one all_gather of a
fixed int64 header, then one all_gather of the padded numeric record and one of the padded JSON metadata. The
padded lengths come from the header, which every rank holds identically after the first collective.
"""

from __future__ import annotations

import datetime
import itertools
import json
import zlib

import torch
import torch.distributed as dist

from ddp_doctor import _log
from ddp_doctor._collective import arrive as group_arrive
from ddp_doctor._collective import global_ranks
from ddp_doctor._compat import default_store
from ddp_doctor.errors import RankMismatchError, ReportTimeoutError
from ddp_doctor.records import ModelInfo, RankRecord

__all__ = ["arrive", "gather"]

logger = _log.get_logger(__name__)

_calls = itertools.count()
_HEADER = ("n_params", "n_buffers", "steps", "meta_bytes", "layout_hash")


def _layout_hash(info: ModelInfo) -> int:
    text = "|".join(f"{n}:{tuple(s)}" for n, s in zip(info.param_names, info.param_shapes))
    return zlib.crc32(text.encode())


def arrive(tag: str, timeout: float) -> None:
    """Wait until every rank reached the same `tag`, or raise naming the ranks that did not.

    Uses the default process group's key-value store, so a missing rank costs a timeout, not a stuck collective.
    """
    store = default_store()
    if store is None:  # without it we rely on the process group's own timeout
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    keys = [f"ddp_doctor/{tag}/{r}" for r in range(world)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # the store raises its own timeout type, which differs by store kind
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            raise
        raise ReportTimeoutError(
            f"rank {rank} waited {timeout:g} s in report() for rank(s) {missing} of world size {world}. report() "
            f"is collective: call it on every rank, after the observe() block. A rank that crashed, exited or is "
            f"still in its loop cannot answer.") from exc


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu() for o in out]


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
    if group is None or group is dist.group.WORLD:
        arrive(f"{tag}/{next(_calls)}", timeout)
    else:
        group_arrive(f"{tag}/{next(_calls)}", group=group, timeout=timeout, call="report()",
                     fix="call it on every rank of the DDP model's process group, after the observe() block.")
    meta = json.dumps({"record": record.meta(), "info": info.to_dict()}).encode()
    n_params, n_buffers = record.used.shape[1], record.buffer_fp.shape[1]
    header = torch.tensor([n_params, n_buffers, record.steps, len(meta), _layout_hash(info)],
                          dtype=torch.int64, device=device)
    headers = [h.tolist() for h in _all_gather(header, group)]
    layouts = {h[_HEADER.index("layout_hash")] for h in headers}
    if len(layouts) > 1 or len({h[1] for h in headers}) > 1:
        members = global_ranks(group, range(len(headers)))
        counts = ", ".join(f"rank {r}: {h[0]} params, {h[1]} buffers" for r, h in zip(members, headers))
        raise RankMismatchError(
            f"the ranks observed different models ({counts}; parameter names or shapes differ). Every rank must "
            f"build the same model, in the same order, before wrapping it in DDP.")

    pad_steps = max(h[2] for h in headers)
    pad_meta = max(h[3] for h in headers)
    flat = _all_gather(record.pack(pad_steps).to(device), group)
    meta_tensor = torch.zeros(pad_meta, dtype=torch.uint8)
    meta_tensor[: len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    metas = _all_gather(meta_tensor.to(device), group)

    records = []
    infos = []
    for r, (h, f, m) in enumerate(zip(headers, flat, metas)):
        decoded = json.loads(bytes(m[: h[3]].tolist()).decode())
        infos.append(ModelInfo.from_dict(decoded["info"]))
        records.append(RankRecord.unpack(f, rank=r, steps=h[2], pad_steps=pad_steps, n_params=n_params,
                                         n_buffers=n_buffers, meta=decoded["record"]))
    info0 = infos[0]
    if group is not None and group is not dist.group.WORLD:
        info0.group_ranks = global_ranks(group, range(len(headers)))
        info0.ddp_config = {**info0.ddp_config, "process_group_ranks": info0.group_ranks}
    return info0, records
