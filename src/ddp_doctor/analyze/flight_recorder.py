"""The first collective where the ranks parted, from PyTorch's Flight Recorder dumps (`core/fr_dumps.py`).

Per process group, the ranks' collectives in sequence order; the first sequence number where the ranks issued
different ops or sizes, or where some ranks issued one and the others none, is the divergence. Each side is named
with its ranks, the op and the user's line from the recorded stack (the first frame outside torch, site-packages and
the standard library). Ranks with no dump (their process died first, or the file was not copied) are named.

Pure: plain data in, `Finding`s out.
"""

from __future__ import annotations

from typing import Any

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.fr_dumps import FrDump, FrEntry
from ddp_doctor.core.ranks import rank_list

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
                findings.append(_mismatch(group, seq, kinds, seqs, by_rank))
                break
    return findings


def _mismatch(
    group: str,
    seq: int,
    kinds: dict[tuple[str, Any], list[int]],
    seqs: dict[int, dict[int, FrEntry]],
    dumps: dict[int, FrDump],
) -> Finding:
    sides = []
    for (op, _), ranks in sorted(kinds.items(), key=lambda kv: (kv[0][0] == "none", kv[1])):
        if op == "none":
            last = [max(seqs[r]) for r in ranks]
            sides.append(f"{rank_list(ranks)} issued none (its last was #{max(last)})")
        else:
            e = seqs[ranks[0]][seq]
            sides.append(f"{rank_list(ranks)} issued {e.describe()} at {e.line or 'an unknown line'}")
    named = sorted(r for ranks in kinds.values() for r in ranks)
    name = "the default group" if group == "0" else f"process group {group}"
    members = next((d.group_ranks.get(group) for d in dumps.values() if d.group_ranks.get(group)), [])
    missing = [r for r in members if r not in dumps]
    start = max(min(s) for s in seqs.values())
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        title=f"at collective #{seq} of {name}, " + " where ".join(sides),
        detail=(
            f"Flight Recorder dumps of {rank_list(sorted(dumps))}: at collective #{seq} of {name}, "
            + "; ".join(sides)
            + f". Every earlier collective of the group in the dumps (from #{start}) matched on every rank."
            + (f" {rank_list(missing)} left no dump." if missing else "")
        ),
        ranks=named,
        fix="make every rank of the group call the same collectives in the same order: a collective inside a "
        "rank-dependent branch (a save or an evaluation on rank 0) must move out of it, or be called on every rank.",
    )
