"""Data-sharding findings: `uneven-inputs` and `sampler-epoch-not-set`. Pure: reads the ranks' loader facts."""

from __future__ import annotations

import itertools
from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import rank_ranges

__all__ = ["sampler_epoch_not_set", "uneven_inputs"]


def _training_loader(meta: dict[str, Any]) -> dict[str, Any]:
    """The first loader the rank iterated while observed that has a length (the training loop's, in practice)."""
    return next((d for d in meta["loaders"] if d.get("batches") is not None), {})


@detects(Code.UNEVEN_INPUTS)
def uneven_inputs(v: View) -> list[Finding]:
    s = v.summary
    if v.world < 2 or s.loader_ranks < v.world:
        return []
    most, fewest = s.batches
    if most != fewest:
        short = v.ranks("fewest-batches")
        shown = ", ".join(f"rank {r}: {c}" for r, c in enumerate(s.first_batches[:8]))
        names = rank_ranges(short.ranks, more=short.more)
        sampler = _training_loader(v.meta(short.ranks[0])).get("sampler")
        return [
            rules.uneven_inputs(
                title=f"ranks have different numbers of batches per epoch ({shown})",
                cause=f"{'Ranks' if short.count > 1 else 'Rank'} {names} run{'' if short.count > 1 else 's'} out after "
                f"{fewest} batches, at batch {fewest} of the first epoch, while the others still train",
                note=f"Sampler: {sampler}.",
                ranks=list(range(v.world)),
                steps=[fewest],
            )
        ]
    if s.padded:
        d = _training_loader(v.meta(0))
        pad = s.padded
        return [
            Finding(
                code=Code.UNEVEN_INPUTS,
                severity="info",
                title=f"equal batch counts only thanks to {pad} padded sample(s)",
                detail=f"DistributedSampler(drop_last=False) repeats {pad} sample(s) so that the {d.get('dataset')} "
                f"samples split evenly over {v.world} ranks: every rank gets {fewest} batches, and those samples "
                "count twice in each epoch. Harmless for training; it skews an evaluation metric.",
                ranks=list(range(v.world)),
                steps=[],
                fix="DistributedSampler(..., drop_last=True) drops them instead; for evaluation, count only the first "
                "len(dataset) samples.",
            )
        ]
    return []


def _loader_site(d: dict[str, Any]) -> str | None:
    if d.get("site"):
        return f"created at {d['site']}"
    return f"first iterated at {d['iterated_at']}" if d.get("iterated_at") else None


@detects(Code.SAMPLER_EPOCH_NOT_SET)
def sampler_epoch_not_set(v: View) -> list[Finding]:
    """A shuffling DistributedSampler whose loader started a pass again with the sampler's epoch unchanged.

    Only a loader iterated more than once while observed tells: a loop that stayed in its first epoch, a
    non-shuffling sampler, or a loader no optimizer step took a batch from (an evaluation loader's, whose order does
    not matter, even with DistributedSampler's default shuffle=True) says nothing.
    """
    findings: list[Finding] = []
    for meta in [v.meta(0)]:  # every rank's loop has the same shape; rank 0 speaks for it
        for d in meta["loaders"]:
            if d.get("sampler") != "DistributedSampler" or not d.get("shuffle") or d.get("epochs_started", 1) < 2:
                continue
            if d.get("trained") is False:  # an evaluation loader: the order it visits samples in does not matter
                continue
            seen = [e for e in d.get("epochs_seen", []) if e is not None]
            if any(a == b for a, b in itertools.pairwise(seen)):
                findings.append(
                    rules.sampler_epoch_repeated(
                        epoch=seen[-1], ranks=list(range(v.world)), site=_loader_site(d), seen=seen
                    )
                )
    return findings
