"""A rank's live position, kept in a small memory-mapped file that outlives the rank.

The rank writes its step, phase and the last collective it entered at every change (a few hundred bytes copied
into shared memory: no system call, no fsync), so the supervising process can read where a rank was even after it
was killed by SIGKILL or aborted by gloo. A sampled position (the watchdog's stack walk) carries its age; these
fields do not need one: they are exact up to the moment the rank died.

Layout: a fixed 4 KiB file. Byte 0..7 a sequence number (odd while a write is in progress), 8..15 the length of
the JSON that follows from byte 16. A reader retries while the sequence number is odd or changed under it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

__all__ = ["Beacon", "read_beacon"]

_SIZE = 4096
_HEAD = struct.Struct("<QQ")


class Beacon:
    """The writer side, one per rank."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._seq = 0
        self.state: dict[str, Any] = {
            "step": -1,
            "phase": "before DDP was built",
            "collective": None,
            "collectives": 0,
            "time": time.time(),
        }
        self._write()

    def update(self, **fields: Any) -> None:
        """Merge `fields` into the state and publish it."""
        self.state.update(fields)
        self.state["time"] = time.time()
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.state, default=str).encode()[: _SIZE - _HEAD.size]
        self._seq += 1  # odd: a write is in progress
        _HEAD.pack_into(self._map, 0, self._seq, 0)
        self._map[_HEAD.size : _HEAD.size + len(data)] = data
        self._seq += 1
        _HEAD.pack_into(self._map, 0, self._seq, len(data))


def read_beacon(path: Path) -> dict[str, Any] | None:
    """The last state a rank published, or None when there is no readable beacon."""
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
            return json.loads(raw[_HEAD.size : _HEAD.size + length])
        except ValueError:
            time.sleep(0.001)
    return None
