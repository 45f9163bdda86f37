"""PyTorch's Flight Recorder dumps, read: one file per rank, pickled (or JSON), format version 2.x.

A job run with `TORCH_FR_BUFFER_SIZE=N` keeps, per rank, a ring of its last N collectives: the op, the sizes, the
process group, its sequence number in that group, and the Python stack that issued it. NCCL's watchdog writes it to
`TORCH_FR_DUMP_TEMP_FILE<rank>` on a timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT=1`); gloo records the same entries but
writes no file itself (a script, or `watch`, calls `torch._C._distributed_c10d._dump_fr_trace`). Plain data, no
torch: `analyze/flight_recorder.py` compares the ranks.
"""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FrDump", "FrEntry", "read_dumps"]

_KNOWN_MAJOR = "2"
_NOT_USER = ("/site-packages/", "/dist-packages/", "/torch/", "/ddp_doctor/", "/lib/python3")
"""Frames that are not the script's: torch's, installed packages', the standard library's, ddp-doctor's own probes."""


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


def read_dumps(folder: Path, pattern: str = "*") -> tuple[list[FrDump], list[str]]:
    """Every Flight Recorder dump in `folder` whose name matches `pattern` (the rank from the number the name ends
    with, before any suffix), and what could not be read, in words (a file of an unknown format version, one without
    a rank in its name)."""
    dumps, problems = [], []
    for path in sorted(p for p in folder.glob(pattern) if p.is_file()):
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
        match = re.search(r"(\d+)(?:\.fr)?$", path.name)
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
