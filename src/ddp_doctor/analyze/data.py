"""Data-sharding findings: `uneven-inputs` and `sampler-epoch-not-set`. Pure: reads the ranks' loader facts."""

from __future__ import annotations

import itertools
from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.view import View
from ddp_doctor.report.model import Finding

__all__ = ["sampler_epoch_not_set", "uneven_inputs"]


def _training_loader(record: Any) -> dict[str, Any] | None:
    """The first loader the rank iterated while observed that has a length (the training loop's, in practice)."""
    return next((d for d in record.loaders if d.get("batches") is not None), None)


def uneven_inputs(v: View) -> list[Finding]:
    loaders = {r.rank: _training_loader(r) for r in v.records}
    known = {rank: d for rank, d in loaders.items() if d is not None}
    if v.world < 2 or len(known) < v.world:
        return []
    counts = {rank: int(d["batches"]) for rank, d in known.items()}
    fewest = min(counts.values())
    if len(set(counts.values())) > 1:
        short = sorted(r for r, c in counts.items() if c == fewest)
        shown = ", ".join(f"rank {r}: {c}" for r, c in sorted(counts.items())[:8])
        return [rules.uneven_inputs(
            title=f"ranks have different numbers of batches per epoch ({shown})",
            cause=f"{'Ranks' if len(short) > 1 else 'Rank'} {', '.join(map(str, short))} "
                  f"run{'' if len(short) > 1 else 's'} out after {fewest} batches, at batch {fewest} of the first "
                  f"epoch, while the others still train",
            note=f"Sampler: {known[short[0]].get('sampler')}.", ranks=sorted(counts), steps=[fewest])]
    padded = {rank: int(d.get("padded") or 0) for rank, d in known.items()}
    if any(padded.values()):
        d = known[0] if 0 in known else next(iter(known.values()))
        pad = max(padded.values())
        return [Finding(
            code="uneven-inputs", severity="info",
            title=f"equal batch counts only thanks to {pad} padded sample(s)",
            detail=f"DistributedSampler(drop_last=False) repeats {pad} sample(s) so that the {d.get('dataset')} "
                   f"samples split evenly over {v.world} ranks: every rank gets {fewest} batches, and those samples "
                   "count twice in each epoch. Harmless for training; it skews an evaluation metric.",
            ranks=sorted(padded), steps=[],
            fix="DistributedSampler(..., drop_last=True) drops them instead; for evaluation, count only the first "
                "len(dataset) samples.")]
    return []


def sampler_epoch_not_set(v: View) -> list[Finding]:
    findings: list[Finding] = []
    for r in v.records[:1]:   # every rank's loop has the same shape; rank 0 speaks for it
        for d in r.loaders:
            if d.get("sampler") != "DistributedSampler" or not d.get("shuffle"):
                continue
            seen = [e for e in d.get("epochs_seen", []) if e is not None]
            repeated = any(a == b for a, b in itertools.pairwise(seen))
            if d.get("epochs_started", 1) >= 2 and repeated:
                findings.append(rules.sampler_epoch_repeated(epoch=seen[-1], ranks=list(range(v.world))))
            elif d.get("epochs_started", 1) == 1 and not d.get("set_epoch_called") and seen and seen[0] == 0:
                findings.append(Finding(
                    code="sampler-epoch-not-set", severity="info",
                    title="a shuffling DistributedSampler: set_epoch not called yet",
                    detail=f"The observed steps stayed in the first epoch ({d.get('batches')} batches per epoch, "
                           f"first batch at observed step {d.get('first_step', 0)}), and set_epoch was not called "
                           "before it. What cannot be known from these steps: whether the loop calls set_epoch when "
                           "the next epoch starts. If it does not, every epoch repeats the same order.",
                    ranks=list(range(v.world)), steps=[],
                    fix="call sampler.set_epoch(epoch) at the start of every epoch (set_epoch(0) before the first "
                        "one makes this check certain)."))
    return findings
