"""The exchange after following a script through its epoch ends: each rank's `FollowRecord` in, the
`FollowSummary` every rank agrees on out. Collective over the world, with the same sequence of all_reduces on every
rank: every shape comes from values already reduced, and what a rank sends does not grow with the world size (the
loaders of the lowest ranks whose loader list differs, up to 8; the real lengths of the first 8 ranks).

Who worked alone: the sync points of every rank are aligned by position (they are collectives, so when their counts
agree the k-th one is the same meeting on every rank). For each, the gap before it (the time since the rank left
the previous one) is compared: the rank with the longest gap kept the others waiting by that gap less the longest
gap among the others. Gaps are host time: on GPUs with NCCL, whose collectives do not block the host, they still
show the host-side work (an evaluation loop) that kept one rank from the meeting.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

from ddp_doctor.core.following import COUNTED_PASSES, AloneSpan, FollowRecord, FollowSummary, SyncPoint
from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.oddranks import name_flagged_rounds, pick_rounds
from ddp_doctor.exchange.packing import Op, Reply, from_words, to_words
from ddp_doctor.exchange.primitives import arrive, minmax_rounds

__all__ = ["KINDS", "exchange_follow", "follow_rounds", "projected_gaps"]

KINDS = ("collective", "ddp-broadcast", "ddp-step")
_FIRST = 8
"""Ranks whose real loader lengths are listed one by one."""


def _share_texts(texts: list[str | None]) -> Generator[Op, Reply, list[str]]:
    """Entry i of `texts` as held by the rank that passes a string there (exactly one rank per entry)."""
    data = [(t or "").encode() for t in texts]
    mine = torch.tensor([float(len(d)) if t is not None else 0.0 for d, t in zip(data, texts)], dtype=torch.float64)
    sizes = (yield ("max", mine)).tensor.to(torch.int64).tolist()
    n_words = -(-max(sizes, default=0) // 8)
    if not n_words:
        return ["" for _ in texts]
    rows = torch.zeros(len(texts), n_words, dtype=torch.int64)
    for i, (d, t) in enumerate(zip(data, texts)):
        if t is not None:
            rows[i] = to_words(d, n_words)
    summed = (yield ("sum", rows)).tensor
    return [from_words(summed[i], sizes[i]).decode(errors="replace") for i in range(len(texts))]


def projected_gaps(record: FollowRecord) -> tuple[list[float], list[float], list[bool], list[list[str]]]:
    """Per sync point: the gap before it (seconds), the gap with each capped pass inside it run to its real length,
    whether that projection is known (every capped pass in it has a length), and the capped passes in words."""
    gaps, projected, known, shown = [], [], [], []
    previous = record.started_at
    for sync in record.syncs:
        gap = max(0.0, sync.enter - previous)
        extra, ok, words = 0.0, True, []
        for p in record.passes:
            if p["started"] < previous or p["ended"] > sync.enter or not p["capped"] or not p["yielded"]:
                continue
            took = p["ended"] - p["started"]
            if p["batches"] is None:
                ok = False
                words.append(f"{p['site']}: {p['yielded']} batches (no length), {took:.2f} s")
                continue
            extra += took * (p["batches"] / p["yielded"] - 1.0)
            words.append(f"{p['site']}: {p['yielded']} of {p['batches']} batches, {took:.2f} s")
        gaps.append(gap)
        projected.append(gap + extra)
        known.append(ok)
        shown.append(words)
        previous = sync.exit
    return gaps, projected, known, shown


def shown(x: float) -> int | None:
    """A length as reduced: -1 (never iterated) and -2 (no length) are None."""
    return int(x) if x >= 0 else None


def _site(sync: SyncPoint | None, fallback: str) -> str:
    if sync is None:
        return fallback
    return f"{sync.what} at {sync.site}" if sync.site else sync.what


def exchange_follow(record: FollowRecord, *, timeout: float, device: torch.device) -> FollowSummary:
    """Reduce every rank's `record` into the `FollowSummary` (`follow_rounds`). Collective over the world.

    Raises:
        ReportTimeoutError: a rank did not arrive within `timeout` seconds.
    """
    arrive(
        "follow",
        group=None,
        timeout=timeout,
        call="the end of following",
        fix="every rank ends following at the same epoch end, or at the script's end.",
    )
    rounds = follow_rounds(record, rank=dist.get_rank(), world=dist.get_world_size())
    return drive(rounds, group=None, device=device)


def follow_rounds(record: FollowRecord, *, rank: int, world: int) -> Generator[Op, Reply, FollowSummary]:
    """Group rank `rank`'s side of the rounds that reduce every rank's `record` into the `FollowSummary`, every
    shape decided by values already reduced (`simulate.lockstep` runs them for 1,024 ranks at once)."""
    counts = [record.counts.get(k, 0) for k in KINDS]
    header = torch.tensor(
        [*counts, len(record.syncs), record.epoch_ends, int(record.followed), record.seconds, int(record.declined)],
        dtype=torch.float64,
    )
    hi, lo = yield from minmax_rounds(header)
    loaders = yield from _loaders(record, rank, world)
    files, unlisted = yield from _files(record, rank, world)
    summary = FollowSummary(
        followed=bool(lo[5] > 0),
        declined=bool(hi[7] > 0),
        epoch_ends=int(lo[4]),
        ended_by=record.ended_by,
        seconds=float(hi[6]),
        loaders=loaders,
        counts={k: (int(hi[i]), int(lo[i])) for i, k in enumerate(KINDS)},
        timeout_s=record.timeout_s,
        files=files,
        files_unlisted=unlisted,
    )
    if not summary.followed:
        return summary
    # A forward through the wrapper without autograd that broadcast buffers on some ranks only: even when the
    # counts agree (DDP then skips the broadcast of that rank's next forward), its broadcast pairs with a training
    # forward's on the others, and one such forward after the last training step leaves a collective unmatched.
    lone = torch.tensor([bool(record.extra_broadcast_sites)])
    n_lone = int((yield ("sum", lone.to(torch.float64))).tensor[0])
    counts_differ = any(hi[i] != lo[i] for i in range(len(KINDS)))
    if counts_differ or 0 < n_lone < world:
        total = sum(counts)
        fewest = int(sum(lo[i] for i in range(len(KINDS))))
        flags = torch.tensor([total > fewest]) if counts_differ else lone
        [named] = yield from name_flagged_rounds(flags, rank=rank, world=world)
        summary.more_ranks = named.examples
        summary.lone_broadcasts = not counts_differ
        if named.examples:
            first = named.examples[0]
            [text] = yield from _share_texts([json.dumps(record.extra_broadcast_sites) if rank == first else None])
            summary.extra_sites = json.loads(text) if text else []
        return summary
    if hi[3] != lo[3] or not record.syncs:
        return summary
    summary.alone = yield from _alone(record, rank, world)
    return summary


def _longest(
    values: list[float], rank: int, world: int
) -> Generator[Op, Reply, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per entry: the lowest rank holding the largest value, that value, and the largest among the other ranks."""
    mine = torch.tensor(values, dtype=torch.float64)
    longest, _ = yield from minmax_rounds(mine)
    named = yield from name_flagged_rounds(mine >= longest, rank=rank, world=world, limit=1)
    owners = torch.tensor([n.examples[0] for n in named], dtype=torch.int64)
    others = torch.where(owners == rank, torch.full_like(mine, -math.inf), mine)
    return owners, longest, (yield ("max", others)).tensor


def _alone(record: FollowRecord, rank: int, world: int) -> Generator[Op, Reply, AloneSpan | None]:
    """The sync point at which one rank kept the others waiting longest (see the module docstring)."""
    if world < 2:
        return None
    gaps, projected, known, shown = projected_gaps(record)
    m_owner, m_long, m_second = yield from _longest(gaps, rank, world)
    p_owner, p_long, p_second = yield from _longest(projected, rank, world)
    _, all_known = yield from minmax_rounds(torch.tensor(known, dtype=torch.float64))
    measured, project = m_long - m_second, p_long - p_second
    score = torch.where(all_known > 0, project, measured)
    at = int(score.argmax())
    owner = int(p_owner[at] if all_known[at] > 0 else m_owner[at])
    text = None
    if rank == owner:
        before = record.syncs[at - 1] if at else None
        text = json.dumps(
            {
                "start": _site(before, "the end of the observed steps"),
                "end": _site(record.syncs[at], "the end of following"),
                "passes": shown[at],
            }
        )
    [shared] = yield from _share_texts([text])
    detail: dict[str, Any] = json.loads(shared)
    return AloneSpan(
        rank=owner,
        measured_s=max(0.0, float(measured[at])),
        projected_s=max(0.0, float(project[at])) if all_known[at] > 0 else None,
        start=detail["start"],
        end=detail["end"],
        passes=detail["passes"],
    )


def _loaders(record: FollowRecord, rank: int, world: int) -> Generator[Op, Reply, list[dict[str, Any]]]:
    """The union of the loaders of rank 0 and of the lowest ranks whose list differs, with the real length on each
    rank: `min`, `max` and `by_rank` (the first ranks)."""
    mine = {seen.key: seen for seen in record.loaders}
    listing = json.dumps([[s.key, s.site, s.sampler] for s in record.loaders])
    digest = float(zlib.crc32(listing.encode()))
    hi, lo = yield from minmax_rounds(torch.tensor([digest], dtype=torch.float64))
    owners = [0]
    if hi[0] != lo[0]:
        ref = (yield from pick_rounds(torch.tensor([[digest]], dtype=torch.float64), torch.tensor([0]), rank=rank))[0]
        [named] = yield from name_flagged_rounds(torch.tensor([digest != float(ref[0])]), rank=rank, world=world)
        owners += named.examples
    texts = yield from _share_texts([listing if rank == o else None for o in owners])
    union: list[list[Any]] = []
    for text in texts:
        for key, site, sampler in json.loads(text):
            if all(key != u[0] for u in union):
                union.append([key, site, sampler])
    n = len(union)
    if not n:
        return []
    # -1: this rank never iterated it; -2: it has no length.
    lengths = torch.tensor(
        [
            float(mine[k].batches) if k in mine and mine[k].batches is not None else (-2.0 if k in mine else -1.0)
            for k, _, _ in union
        ],
        dtype=torch.float64,
    )
    facts = torch.tensor(
        [
            [float(mine[k].passes), float(mine[k].most), float(mine[k].capped), float(mine[k].training)]
            if k in mine
            else [0.0, 0.0, 0.0, 0.0]
            for k, _, _ in union
        ],
        dtype=torch.float64,
    )
    l_hi, l_lo = yield from minmax_rounds(lengths)
    f_hi, _ = yield from minmax_rounds(facts)
    # The batches of each loader's first passes, counted where a pass ran to its end (-1: capped, left early or
    # never started), and the batches each handed out at all (a lower bound).
    counted = torch.full((n, COUNTED_PASSES), -1.0, dtype=torch.float64)
    floors = torch.zeros(n, COUNTED_PASSES, dtype=torch.float64)
    for j, (k, _, _) in enumerate(union):
        if k in mine:
            for i, (c, f) in enumerate(zip(mine[k].counted, mine[k].floors)):
                counted[j, i], floors[j, i] = float(c), float(f)
    big = float(2**50)
    c_hi, _ = yield from minmax_rounds(torch.stack([counted, floors]))
    _, c_lo = yield from minmax_rounds(torch.where(counted >= 0, counted, torch.full_like(counted, big)))
    present = torch.cat([(counted >= 0).to(torch.float64).reshape(-1), (lengths != -1).to(torch.float64)])
    sums = (yield ("sum", present)).tensor
    n_counted, iterated = sums[: n * COUNTED_PASSES].reshape(n, COUNTED_PASSES), sums[n * COUNTED_PASSES :]
    first = min(world, _FIRST)
    rows = torch.zeros(first, n, 1 + 2 * COUNTED_PASSES, dtype=torch.float64)
    if rank < first:
        rows[rank] = torch.cat([lengths.unsqueeze(1), counted, floors], 1)
    by_rank = (yield from pick_rounds(rows.reshape(first, -1), torch.arange(first), rank=rank)).reshape(rows.shape)
    # Per loader, the first pass whose counts differ: two ranks ran it to different ends, or one rank handed out
    # more batches than another's whole pass.
    uneven: dict[int, int] = {}
    for j in range(n):
        for i in range(COUNTED_PASSES):
            lo, hi, floor = float(c_lo[j, i]), float(c_hi[0, j, i]), float(c_hi[1, j, i])
            if lo < big and (hi > lo or floor > lo):
                uneven[j] = i
                break
    fewest = {}
    if uneven:
        flags = torch.tensor([float(counted[j, i]) == float(c_lo[j, i]) for j, i in uneven.items()])
        fewest = dict(zip(uneven, (yield from name_flagged_rounds(flags, rank=rank, world=world))))
    out = []
    for j, (_key, site, sampler) in enumerate(union):
        at = uneven.get(j)
        if at is None:  # the first pass counted on every rank that iterated the loader, else the first counted
            full = [i for i in range(COUNTED_PASSES) if n_counted[j, i] > 0]
            every = [i for i in full if n_counted[j, i] >= iterated[j]]
            at = (every or full or [None])[0]
        count: dict[str, Any] = {"pass": None, "uneven": False}
        if at is not None:
            count = {
                "pass": at + 1,
                "uneven": j in uneven,
                "min": int(c_lo[j, at]),
                "max": int(max(c_hi[0, j, at], c_hi[1, j, at])),
                "by_rank": [shown(float(x)) for x in by_rank[:, j, 1 + at].tolist()],
                "at_least_by_rank": [int(x) for x in by_rank[:, j, 1 + COUNTED_PASSES + at].tolist()],
                "ranks_counted": int(n_counted[j, at]),
            }
            if j in fewest:
                count["fewest_ranks"], count["more_fewest"] = fewest[j].examples, fewest[j].more
        # Passes that ended at the check's cap (or where the check ended the observed steps): their real count is
        # unknown where the loader has no len().
        count["all_first_counted"] = bool(n_counted[j, 0] >= iterated[j] > 0)
        out.append(
            {
                "site": site,
                "ordinal": int(_ordinal(_key)),
                "sampler": sampler,
                "batches": {
                    "min": shown(float(l_lo[j])) if l_lo[j] != -1 else shown(float(l_hi[j])),
                    "max": shown(float(l_hi[j])),
                    "by_rank": [shown(float(x)) for x in by_rank[:, j, 0].tolist()],
                },
                "passes": int(f_hi[j, 0]),
                "most": int(f_hi[j, 1]),
                "capped": int(f_hi[j, 2]),
                "training": bool(f_hi[j, 3]),
                "no_len": bool(l_lo[j] == -2),
                "counted": count,
            }
        )
    return out


def _ordinal(key: str) -> int:
    """The loader's order among those built together at its line, from its key (`site#N|sampler|shuffle`)."""
    head = key.split("|", 1)[0]
    tail = head.rsplit("#", 1)[-1]
    return int(tail) if tail.isdigit() else 1


def _files(record: FollowRecord, rank: int, world: int) -> Generator[Op, Reply, tuple[list[dict[str, Any]], int]]:
    """The union of the files written by rank 0 and by the lowest ranks whose list differs (up to 8), each with the
    ranks that wrote it; and how many ranks' differing lists were left out."""
    listing = json.dumps(sorted([f["path"], f["shown"], f["site"], f["how"], f["existed"]] for f in record.files))
    digest = float(zlib.crc32(listing.encode()))
    hi, lo = yield from minmax_rounds(torch.tensor([digest], dtype=torch.float64))
    owners, unlisted = [0], 0
    if hi[0] != lo[0]:
        ref = (yield from pick_rounds(torch.tensor([[digest]], dtype=torch.float64), torch.tensor([0]), rank=rank))[0]
        [named] = yield from name_flagged_rounds(torch.tensor([digest != float(ref[0])]), rank=rank, world=world)
        owners += named.examples
        unlisted = named.more
    texts = yield from _share_texts([listing if rank == o else None for o in owners])
    union: list[list[Any]] = []
    for text in texts:
        for entry in json.loads(text) if text else []:
            if all(entry[0] != u[0] for u in union):
                union.append(entry)
    if not union:
        return [], unlisted
    mine = {f["path"] for f in record.files}
    wrote = yield from name_flagged_rounds(torch.tensor([u[0] in mine for u in union]), rank=rank, world=world)
    return [
        {"path": path, "shown": shown_, "site": site, "how": how, "existed": existed, "ranks": w.examples}
        | ({"more_ranks": w.more} if w.more else {})
        for (path, shown_, site, how, existed), w in zip(union, wrote)
    ], unlisted
