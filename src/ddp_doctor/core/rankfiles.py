"""What a rank leaves in the node's output folder: one typed, versioned schema, written and read here.

The rank side (`launch/session.py`, `launch/watchdog.py`) writes these files through `write_end` and
`write_progress`; the supervisor (`launch/supervise.py`, `launch/outcome.py`) reads them back through `read_end`
and `rankstate.read_rank_states`, whose `RankState` is the input of `analyze.failures`. Files, not a collective,
because a rank that failed alone cannot count on the others. The live position (`rank{R}.beacon`) has its own
writer and reader in `beacon.py`; the fault dump (`rank{R}.fault`) is Python's faulthandler's, parsed by
`Fault.parse` (`rankstate.py`).

- `rank{R}.beacon`: the rank's step, phase and last collective (op, tensor, call site), published at every change
  into shared memory (`beacon.py`): exact up to the moment the rank died, even by SIGKILL.
- `rank{R}.fault`: Python's faulthandler dump when the rank dies of SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL.
- `report.json` (and `report.steps.json`, the observed steps' report kept while the script is followed through its
  epoch ends): the reports, when the ranks managed to exchange records.
- `rank{R}.json`: `EndRecord` (schema `END_SCHEMA`), how the rank ended.
- `rank{R}.progress.json`: `ProgressSample` (schema `PROGRESS_SCHEMA`), the watchdog's last sample (every half
  second, from a thread that runs while the main thread is blocked in a collective).
- `rank{R}.wrap.json`: `WrapShapes` (schema `WRAP_SCHEMA`), the shapes of the parameters the rank handed to DDP's
  constructor, written just before it runs (a constructor that refuses the model leaves no other record of them).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from ddp_doctor.core.phase import Phase

__all__ = [
    "END_SCHEMA",
    "PHASES",
    "PROGRESS_SCHEMA",
    "EndRecord",
    "ExplainedError",
    "Outcome",
    "ProgressSample",
    "RaisedError",
    "WRAP_SCHEMA",
    "WrapShapes",
    "end_path",
    "progress_path",
    "read_end",
    "read_json",
    "read_ends",
    "read_progress",
    "read_wrap",
    "write_end",
    "write_json",
    "write_progress",
    "wrap_path",
    "write_wrap",
]

END_SCHEMA = "ddp-doctor/rank-end@1"
PROGRESS_SCHEMA = "ddp-doctor/rank-progress@1"
WRAP_SCHEMA = "ddp-doctor/rank-wrap@1"
PHASES = tuple(p.value for p in Phase)
"""The phases a rank reports, in the order they happen within a step (`ddp_doctor.doctor.Phase`)."""


def write_json(path: Path, data: Any) -> None:
    """Write atomically, so a reader (or a kill) never sees half a file."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def end_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.json"


def progress_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.progress.json"


class Outcome(str, Enum):
    """How a rank ended, as written in `rank{R}.json`."""

    REPORTED = "reported"
    """The ranks exchanged records and the report was written."""
    CRASHED = "crashed"
    """The script raised."""
    CRASHED_AFTER_REPORT = "crashed-after-report"
    """The script raised after the report (in `bench`'s timed steps)."""
    EXITED = "exited"
    """The script returned or called `sys.exit` (any status) before the exchange."""
    NO_EXCHANGE = "no-exchange"
    """The rank tried to exchange records and the others did not come."""
    INTERNAL_ERROR = "internal-error"
    """ddp-doctor itself failed on the rank (a bug in the tool, not in the script)."""


@dataclass(kw_only=True, slots=True)
class ExplainedError:
    """DDP's own error, explained by the rank's doctor with parameter names."""

    code: str
    """The finding's code (`reduction-error`, ...)."""
    params: list[str] = field(default_factory=list)
    message: str = ""
    numels: list[int] = field(default_factory=list)
    """The element count of each of `params` (0 where unknown)."""


@dataclass(kw_only=True, slots=True)
class RaisedError:
    """What the script raised on a rank (not `core.findings.Crash`, the in-process API's view of a crash)."""

    type: str
    message: str
    traceback: str = ""
    site: str | None = None
    """The user's line that raised."""
    step: int = -1
    explained: ExplainedError | None = None
    peer_lost: bool = False
    """The error only says a peer went away (connection closed, a timed-out collective): not a cause."""
    phase: str = "?"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RaisedError:
        out = cls(**_known(cls, {k: v for k, v in d.items() if k != "explained"}))
        if d.get("explained"):
            out.explained = ExplainedError(**_known(ExplainedError, d["explained"]))
        return out


@dataclass(kw_only=True, slots=True)
class EndRecord:
    """How a rank ended: `rank{R}.json`."""

    schema: str = END_SCHEMA
    rank: int
    local_rank: int = 0
    world_size: int = 1
    pid: int = 0
    outcome: Outcome
    models: list[dict[str, Any]] = field(default_factory=list)
    """Per DDP model built: site, framework, module, ddp_config, torch_version, backend."""
    ddp_models: int = 0
    reason: str | None = None
    """`REPORTED`: why the report was written (the K steps, the script's end, a crash)."""
    error: str | None = None
    """`NO_EXCHANGE`, `INTERNAL_ERROR`: what failed."""
    traceback: str | None = None
    """`INTERNAL_ERROR`: ddp-doctor's own traceback."""
    raised: RaisedError | None = None
    """`CRASHED`, `CRASHED_AFTER_REPORT`."""
    status: int | None = None
    """`EXITED`: the exit status."""
    site: str | None = None
    """`EXITED`: where the script left (`sys.exit`'s line, or the end of the script)."""
    step: int | None = None
    phase: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EndRecord:
        if d.get("schema") != END_SCHEMA:
            raise ValueError(f"rank end record of schema {d.get('schema')!r}, expected {END_SCHEMA!r}")
        out = cls(**{**_known(cls, d), "outcome": Outcome(d["outcome"]), "raised": None})
        if d.get("raised"):
            out.raised = RaisedError.from_dict(d["raised"])
        return out


def write_end(folder: Path, record: EndRecord, *, overwrite: bool = False) -> bool:
    """Write `rank{R}.json` unless one is there already (the first ending wins) or `overwrite`. True if written."""
    path = end_path(folder, record.rank)
    if not overwrite and path.exists():
        return False
    write_json(path, record.to_dict())
    return True


def read_end(path: Path) -> EndRecord | None:
    """A rank's end record, or None when the file is missing, half written or of another schema."""
    data = read_json(path)
    if data is None:
        return None
    try:
        return EndRecord.from_dict(data)
    except (ValueError, TypeError, KeyError):
        return None


def read_ends(folder: Path) -> dict[int, EndRecord]:
    """Every rank's end record in `folder`, by rank."""
    out = {}
    for path in sorted(folder.glob("rank*.json")):
        if not path.name.endswith((".progress.json", ".wrap.json")) and (end := read_end(path)) is not None:
            out[end.rank] = end
    return out


@dataclass(kw_only=True, slots=True)
class WrapShapes:
    """The parameters a rank handed to DDP's constructor, in DDP's order: `rank{R}.wrap.json`."""

    schema: str = WRAP_SCHEMA
    rank: int
    site: str | None = None
    """The user's line that built DDP."""
    names: list[str] = field(default_factory=list)
    """The trainable parameters DDP verifies (its `params[i]` is `names[i]`)."""
    shapes: list[list[int]] = field(default_factory=list)
    torch_version: str = ""
    backend: str = ""
    """The run's, for the report's header when DDP's constructor refused the model."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WrapShapes:
        if d.get("schema") != WRAP_SCHEMA:
            raise ValueError(f"rank wrap record of schema {d.get('schema')!r}, expected {WRAP_SCHEMA!r}")
        return cls(**_known(cls, d))


def wrap_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.wrap.json"


def write_wrap(folder: Path, record: WrapShapes) -> None:
    write_json(wrap_path(folder, record.rank), record.to_dict())


def read_wrap(path: Path) -> WrapShapes | None:
    """A rank's wrap record, or None when the file is missing, half written or of another schema."""
    data = read_json(path)
    if data is None:
        return None
    try:
        return WrapShapes.from_dict(data)
    except (ValueError, TypeError, KeyError):
        return None


@dataclass(kw_only=True, slots=True)
class ProgressSample:
    """Where the rank's main thread is, sampled by its watchdog: `rank{R}.progress.json`."""

    schema: str = PROGRESS_SCHEMA
    rank: int
    local_rank: int = 0
    world_size: int = 1
    pid: int = 0
    ddp_models: int = 0
    models: list[dict[str, Any]] = field(default_factory=list)
    step: int = -1
    phase: str = "before DDP was built"
    user_frame: str | None = None
    """The user's innermost line on the main thread."""
    innermost: str | None = None
    """The innermost frame on the main thread, whoever's ("file:line in function")."""
    ended: bool = False
    """The rank is done (it wrote its end record and is leaving)."""
    time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProgressSample:
        if d.get("schema") != PROGRESS_SCHEMA:
            raise ValueError(f"progress sample of schema {d.get('schema')!r}, expected {PROGRESS_SCHEMA!r}")
        return cls(**_known(cls, d))


def write_progress(folder: Path, sample: ProgressSample) -> None:
    write_json(progress_path(folder, sample.rank), sample.to_dict())


def read_progress(path: Path) -> ProgressSample | None:
    data = read_json(path)
    if data is None:
        return None
    try:
        return ProgressSample.from_dict(data)
    except (ValueError, TypeError):
        return None
