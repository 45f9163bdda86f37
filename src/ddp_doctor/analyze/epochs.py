"""Data-sharding findings: `uneven-inputs` and `sampler-epoch-not-set`. Pure: reads the ranks' loader facts."""

from __future__ import annotations

import itertools
from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.view import View
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import rank_ranges

__all__ = ["sampler_epoch_not_set", "uneven_inputs"]


def _training_loader(meta: dict[str, Any]) -> dict[str, Any]:
    """The first loader the rank iterated while observed that has a length (the training loop's, in practice)."""
    return next((d for d in meta["loaders"] if d.get("batches") is not None), {})


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
                code="uneven-inputs",
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


def sampler_epoch_not_set(v: View) -> list[Finding]:
    findings: list[Finding] = []
    for meta in [v.meta(0)]:  # every rank's loop has the same shape; rank 0 speaks for it
        for d in meta["loaders"]:
            if d.get("sampler") != "DistributedSampler" or not d.get("shuffle"):
                continue
            seen = [e for e in d.get("epochs_seen", []) if e is not None]
            repeated = any(a == b for a, b in itertools.pairwise(seen))
            if d.get("epochs_started", 1) >= 2 and repeated:
                findings.append(rules.sampler_epoch_repeated(epoch=seen[-1], ranks=list(range(v.world))))
            elif d.get("epochs_started", 1) == 1 and not d.get("set_epoch_called") and seen and seen[0] == 0:
                findings.append(
                    Finding(
                        code="sampler-epoch-not-set",
                        severity="info",
                        title="a shuffling DistributedSampler: set_epoch not called yet",
                        detail=f"The observed steps stayed in the first epoch ({d.get('batches')} batches per epoch, "
                        f"first batch at observed step {d.get('first_step', 0)}), and set_epoch was not called "
                        "before it. What cannot be known from these steps: whether the loop calls set_epoch when "
                        "the next epoch starts. If it does not, every epoch repeats the same order.",
                        ranks=list(range(v.world)),
                        steps=[],
                        fix="call sampler.set_epoch(epoch) at the start of every epoch (set_epoch(0) before the first "
                        "one makes this check certain).",
                    )
                )
    return findings
