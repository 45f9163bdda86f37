"""The first collective where the ranks parted, from PyTorch's Flight Recorder dumps (`core/fr_dumps.py`).

Per process group, the ranks' collectives in sequence order; the first sequence number where the ranks issued
different ops or sizes, or where some ranks issued one and the others none, is the divergence. Each side is named
with its ranks, the op and the user's line from the recorded stack (the first frame outside torch, site-packages and
the standard library). Ranks with no dump (their process died first, or the file was not copied) are named.

Pure: plain data in, `Finding`s out.
"""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.collective_order import dumps_apart
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.fr_dumps import FrDump

__all__ = ["first_divergence"]


def first_divergence(dumps: list[FrDump]) -> list[Finding]:
    """The first collective where the ranks parted, per process group (the default group first); none when every
    rank issued the same collectives."""
    findings = []
    by_rank = {d.rank: d for d in dumps}
    groups = sorted({e.group for d in dumps for e in d.entries}, key=lambda g: (g != "0", g))
    for group in groups:
        seqs = {r: {e.seq: e for e in d.entries if e.group == group} for r, d in by_rank.items()}
        seqs = {r: s for r, s in seqs.items() if s}
        if len(seqs) < 2:
            continue
        start = max(min(s) for s in seqs.values())  # older entries may have left some ranks' rings
        end = max(max(s) for s in seqs.values())
        for seq in range(start, end + 1):
            kinds: dict[tuple[str, Any], list[int]] = {}
            for r, s in sorted(seqs.items()):
                e = s.get(seq)
                key = (e.op, e.sizes) if e is not None else ("none", None)
                kinds.setdefault(key, []).append(r)
            if len(kinds) > 1:
                findings.append(dumps_apart(group, seq, kinds, seqs, by_rank))
                break
    return findings
