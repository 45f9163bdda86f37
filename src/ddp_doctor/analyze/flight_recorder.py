"""PyTorch's Flight Recorder dumps, read to name the first collective where the ranks parted.

A job run with `TORCH_FR_BUFFER_SIZE=N` keeps, per rank, a ring of its last N collectives: the op, the sizes, the
process group, its sequence number in that group, and the Python stack that issued it. NCCL's watchdog writes it to
`TORCH_FR_DUMP_TEMP_FILE<rank>` on a timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT=1`); gloo records the same entries but
writes no file itself (a script, or `watch`, calls `torch._C._distributed_c10d._dump_fr_trace`). One file per rank,
pickled (or JSON), format version 2.x.

The reading: per process group, the ranks' collectives in sequence order; the first sequence number where the ranks
issued different ops or sizes, or where some ranks issued one and the others none, is the divergence. Each side is
named with its ranks, the op and the user's line from the recorded stack (the first frame outside torch, site-packages
and the standard library). Ranks with no dump (their process died first, or the file was not copied) are named.

Pure: plain data in, `Finding`s out.
"""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import rank_list

__all__ = ["FrDump", "FrEntry", "first_divergence", "read_dumps"]

_KNOWN_MAJOR = "2"
_NOT_USER = ("/site-packages/", "/dist-packages/", "/torch/", "/lib/python3")


@dataclass(frozen=True, kw_only=True)
class FrEntry:
    """One collective a rank issued."""

    seq: int
    """Its sequence number among the collectives of its process group (1-based)."""
    op: str
    """`all_reduce`, `barrier`, ... (the backend's prefix dropped)."""
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    group: str
    line: str | None
    """The user's line (`file:line`) from the recorded stack."""

    def describe(self) -> str:
        shape = ", ".join(f"{d.lower()}{list(s)}" for d, s in zip(self.dtypes, self.sizes))
        return f"{self.op}({shape})" if shape else self.op


@dataclass(kw_only=True)
class FrDump:
    """One rank's dump."""

    rank: int
    path: str
    version: str
    entries: list[FrEntry] = field(default_factory=list)
    completed: dict[str, int] = field(default_factory=dict)
    """Per process group: the last collective known completed (`pg_status`; -1 when none)."""
    group_ranks: dict[str, list[int]] = field(default_factory=dict)


def _user_line(frames: list[dict[str, Any]]) -> str | None:
    for f in frames:
        name = str(f.get("filename", ""))
        if name and not name.startswith("<") and not any(part in name for part in _NOT_USER):
            return f"{name}:{f.get('line')}"
    return None


def _load(path: Path) -> dict[str, Any] | None:
    raw = path.read_bytes()
    try:
        data = pickle.loads(raw)  # noqa: S301  (the user's own dump files, which they asked us to read)
    except Exception:  # noqa: BLE001  (not a pickle: maybe the JSON form)
        try:
            data = json.loads(raw)
        except ValueError:
            return None
    return data if isinstance(data, dict) and "entries" in data and "version" in data else None


def _ranks_of(text: Any) -> list[int]:
    try:
        return [int(r) for r in json.loads(text)] if isinstance(text, str) else [int(r) for r in text]
    except (ValueError, TypeError):
        return []


def read_dumps(folder: Path) -> tuple[list[FrDump], list[str]]:
    """Every Flight Recorder dump in `folder` (the rank from the trailing number of the file name), and what could
    not be read, in words (a file of an unknown format version, one without a rank in its name)."""
    dumps, problems = [], []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        try:
            data = _load(path)
        except OSError as exc:
            problems.append(f"{path.name}: cannot be read ({exc.strerror or exc})")
            continue
        if data is None:
            continue
        version = str(data.get("version"))
        if version.split(".")[0] != _KNOWN_MAJOR:
            problems.append(
                f"{path.name}: a Flight Recorder dump of format version {version}, which this reader does not know "
                f"(it reads {_KNOWN_MAJOR}.x): left out"
            )
            continue
        match = re.search(r"(\d+)$", path.name)
        if match is None:
            problems.append(f"{path.name}: no rank at the end of its name (the dump files end in their rank)")
            continue
        dump = FrDump(rank=int(match.group(1)), path=str(path), version=version)
        for e in data["entries"]:
            if e.get("is_p2p"):
                continue
            group = str((e.get("process_group") or ("0", ""))[0])
            dump.entries.append(
                FrEntry(
                    seq=int(e.get("collective_seq_id", 0)),
                    op=str(e.get("profiling_name", "?")).split(":")[-1],
                    sizes=tuple(tuple(int(n) for n in s) for s in e.get("input_sizes") or []),
                    dtypes=tuple(str(d) for d in e.get("input_dtypes") or []),
                    group=group,
                    line=_user_line(e.get("frames") or []),
                )
            )
        for group, status in (data.get("pg_status") or {}).items():
            dump.completed[str(group)] = int(status.get("last_completed_collective", -1))
        for group, config in (data.get("pg_config") or {}).items():
            dump.group_ranks[str(group)] = _ranks_of(config.get("ranks", []))
        dumps.append(dump)
    return dumps, problems


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
