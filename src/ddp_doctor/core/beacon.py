"""A rank's live position, kept in a small memory-mapped file that outlives the rank: written and read here.

The rank writes its step, phase and the last collective it entered at every change (a few hundred bytes copied
into shared memory: no system call, no fsync), so the supervising process can read where a rank was even after it
was killed by SIGKILL or aborted by gloo. A sampled position (the watchdog's stack walk) carries its age; these
fields do not need one: they are exact up to the moment the rank died.

Layout: a fixed 16 KiB file. Byte 0..7 a sequence number (odd while a write is in progress), 8..15 the length of
the JSON that follows from byte 16 (`BeaconState`, schema `BEACON_SCHEMA`). A reader retries while the sequence
number is odd or changed under it. The last 16 bytes hold a step and its time (`Beacon.step`: under `watch`, past
the first steps, every optimizer step is published there in about a microsecond, where the JSON takes tens).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "BEACON_SCHEMA",
    "RECENT",
    "Beacon",
    "BeaconState",
    "ClosedStep",
    "Collective",
    "OptimizerSteps",
    "read_beacon",
]

BEACON_SCHEMA = "ddp-doctor/beacon@1"
_SIZE = 16384
"""Room for the longest state: an FSDP2 rank's three counted maps (forwards, state_dict() calls and gathers by line,
8 lines each) beside the rest, with long paths. 4 KiB could be outgrown there, and a cut JSON reads as no beacon."""
_HEAD = struct.Struct("<QQ")
_STEP = struct.Struct("<qd")
"""The step slot at the file's end: a step and the `time.time()` it was taken."""
_JSON_ROOM = _SIZE - _HEAD.size - _STEP.size


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


RECENT = 8
"""Collectives a beacon keeps (`BeaconState.recent`)."""


@dataclass(kw_only=True, slots=True)
class Collective:
    """A collective the script entered on a rank, or a DDP model's broadcast of its buffers at a forward (DDP's
    gradient all-reduces are not among them)."""

    op: str
    n: int
    """Its position in the rank's sequence of the script's collectives (1-based)."""
    site: str | None = None
    tensor: str | None = None
    step: int | None = None
    phase: str | None = None
    group_size: int | None = None
    ddp_buffers: bool = False
    """A DDP model's broadcast of its buffers at a forward (`tensor` names the model), not a call of the script."""
    copied_at: str | None = None
    """For `ddp_buffers`: the user's line that copied the DDP model it broadcast from (an EMA made with
    `copy.deepcopy` or `AveragedModel`), None for a model its constructor built."""

    def describe(self) -> str:
        return f"{self.op}({self.tensor})" if self.tensor else self.op


@dataclass(kw_only=True, slots=True)
class ClosedStep:
    """The last step a rank closed, and the trainable parameters that got no gradient in it."""

    step: int
    missing: list[str] = field(default_factory=list)
    """At most 16 names (the doctor's cap): 16 means "16 or more"."""


@dataclass(kw_only=True, slots=True)
class BeaconState:
    """What a rank publishes in its beacon."""

    schema: str = BEACON_SCHEMA
    step: int = -1
    phase: str = "before DDP was built"
    model: int | None = None
    """The index of the DDP model (in build order) whose doctor published last."""
    site: str | None = None
    """The user's line at the last phase change."""
    collective: Collective | None = None
    collectives: int = 0
    """How many collectives the rank entered: the script's, and its DDP models' buffer broadcasts."""
    recent: list[Collective] = field(default_factory=list)
    """The last `RECENT` of them, oldest first (`collective` is the last): where two ranks' sequences part."""
    in_collective: bool = False
    closed: ClosedStep | None = None
    sharding: dict[str, Any] | None = None
    """The rank follows a model sharded with FSDP2 (no DDP; its steps are that model's optimizer steps): the sharding
    the report's header names (`ShardedModel.describe`)."""
    backend: str | None = None
    """That model's process group backend (the report's header; a DDP model's is in its model record)."""
    framework: str | None = None
    """The training framework that steps that model's optimizer (`lightning`, ...; a DDP model's is in its model
    record): a failed run's report words its fixes that way."""
    forwards: dict[str, int] = field(default_factory=dict)
    """Forwards through that sharded model since its first optimizer step, by the user's line (8 lines at most)."""
    forward_first: dict[str, list[Any]] = field(default_factory=dict)
    """For each line of `forwards`: the optimizer step in progress when it first ran a forward, and whether in grad
    mode (a training pass, whose backward follows)."""
    fully_shard: dict[str, Any] | None = None
    """The script's `fully_shard` calls: how many (`calls`), the first one's line (`site`), and the first
    mixed-precision policy one was given (`policy`: its `site`, `param_dtype`, `cast_forward_inputs`), published as
    they are made: a rank that fails before its first optimizer step is known to run an FSDP2 job."""
    train_loader: dict[str, Any] | None = None
    """The DataLoader the sharded model's last optimizer step trained on: its `site` and `batches` (`len()` on this
    rank), published when it changes: ranks of different lengths run out at different steps."""
    state_dicts: dict[str, int] = field(default_factory=dict)
    """`state_dict()` calls on that sharded model since then, by the user's line (8 at most): FSDP2 reshards a
    module a forward left unsharded there, on the calling ranks only."""
    gathers: dict[str, int] = field(default_factory=dict)
    """Calls that gathered sharded tensors in full (`DTensor.redistribute` from a sharded placement: `full_tensor`,
    `get_model_state_dict(..., full_state_dict=True)`) since then, by `call at file:line` (8 at most). Published
    when a line first gathers, before its collective: a rank that then dies or hangs in it has told where it was."""
    crashed: bool = False
    """The script raised on this rank; set before the crash is recorded (which publishes the failed step as closed),
    so a peer never takes a crashed rank for one that waits in DDP's all-reduce."""
    group_timeout: float | None = None
    """The default process group's timeout in seconds, once known (`watch` calls a hang before it ends the job)."""
    time: float = 0.0
    """`time.time()` of the last change."""
    pid: int = 0
    """The rank's process id: a peer on the same node reads from /proc whether its main thread is blocked."""

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values. Written at every collective a rank enters and leaves: its dataclasses
        are read field by field (`asdict`'s deep copy of every value tripled the cost of a write with `recent`)."""
        out = {name: getattr(self, name) for name in _FIELDS}
        out["collective"] = _flat(self.collective)
        out["closed"] = _flat(self.closed)
        out["recent"] = [_flat(c) for c in self.recent]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BeaconState:
        if d.get("schema", BEACON_SCHEMA) != BEACON_SCHEMA:
            raise ValueError(f"beacon schema {d.get('schema')!r}, expected {BEACON_SCHEMA!r}")
        out = cls(**_known(cls, {k: v for k, v in d.items() if k not in ("collective", "closed", "recent")}))
        if d.get("collective"):
            out.collective = Collective(**_known(Collective, d["collective"]))
        out.recent = [Collective(**_known(Collective, c)) for c in d.get("recent") or []]
        if d.get("closed"):
            out.closed = ClosedStep(**_known(ClosedStep, d["closed"]))
        return out


class Beacon:
    """The writer side, one per rank; `state` writes a state read elsewhere (another node's rank, from the
    rendezvous store) instead of a new one of this process."""

    def __init__(self, path: Path, state: BeaconState | None = None) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._seq = 0
        self.state = state if state is not None else BeaconState(time=time.time(), pid=os.getpid())
        self._write()

    def update(self, **changes: Any) -> None:
        """Set `changes` (`BeaconState` field names) and publish the state.

        Raises:
            AttributeError: a name that is no field of `BeaconState` (slots: a typo cannot add a field).
        """
        for name, value in changes.items():
            setattr(self.state, name, value)
        self.state.time = time.time()
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.state.to_dict(), default=str).encode()[:_JSON_ROOM]
        self._seq += 1  # odd: a write is in progress
        _HEAD.pack_into(self._map, 0, self._seq, 0)
        self._map[_HEAD.size : _HEAD.size + len(data)] = data
        self._seq += 1
        _HEAD.pack_into(self._map, 0, self._seq, len(data))

    def step(self, step: int) -> None:
        """Publish `step` alone, in the step slot (a reader takes it over the JSON's when it is later)."""
        self.state.step = step
        _STEP.pack_into(self._map, _SIZE - _STEP.size, step, time.time())


_FIELDS = tuple(f.name for f in fields(BeaconState))


def _flat(value: Collective | ClosedStep | None) -> dict[str, Any] | None:
    """A flat dataclass as a dict (its values are plain: numbers, strings, lists of strings)."""
    return None if value is None else {f.name: getattr(value, f.name) for f in fields(value)}


def read_beacon(path: Path) -> BeaconState | None:
    """The last state a rank published, or None when there is no readable beacon (or one of another schema)."""
    for _ in range(20):
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        if len(raw) < _HEAD.size:
            return None
        seq, length = _HEAD.unpack_from(raw, 0)
        if seq % 2 == 1 or length == 0:
            time.sleep(0.001)
            continue
        try:
            state = BeaconState.from_dict(json.loads(raw[_HEAD.size : _HEAD.size + length]))
        except (ValueError, TypeError):
            time.sleep(0.001)
            continue
        if len(raw) >= _SIZE:
            step, at = _STEP.unpack_from(raw, _SIZE - _STEP.size)
            if at and step > state.step:  # 0.0: never written
                state.step, state.time = step, max(state.time, at)
        return state
    return None


class OptimizerSteps:
    """The steps a rank trains once no doctor counts them (`watch` past its report, a report waiting for a Join's
    end), published in `beacon`: each optimizer's own count of `step()` calls past `base`, the most of them (a GAN's
    two optimizers step once each per training step)."""

    def __init__(self, beacon: Beacon, base: int) -> None:
        self.beacon = beacon
        self.base = base
        self._counts: dict[int, int] = {}

    def stepped(self, optimizer: object) -> int | None:
        """Count one `step()` of `optimizer`; returns the new step when the count moved the rank's step, else None."""
        n = self._counts[id(optimizer)] = self._counts.get(id(optimizer), 0) + 1
        if self.base + n <= self.beacon.state.step:
            return None
        self.beacon.step(self.base + n)
        return self.base + n
