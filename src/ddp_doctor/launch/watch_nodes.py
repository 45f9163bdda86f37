"""`ddp-doctor watch` on several nodes: each node's watch shares its ranks' records through torchrun's rendezvous
store, so that a hang is called, and explained, from every node's ranks, without a shared file system.

Under `--rdzv-backend c10d` the first agent hosts a TCP store at `--rdzv-endpoint` for the whole job; under the
static rendezvous (`--master-addr`, `--master-port`, `--node-rank`) node 0's agent hosts it at the master's port. Each node's
watch connects to it as a client, takes a node number (`add` on a counter), and sets a small key with how long ago
one of its ranks last moved, by its own clock (every two seconds; every half second once its ranks have stood still
for a second); from then on also a second key, every two seconds, with their files as they are in its run folder
(each rank's beacon, sampled line and end record: a few kilobytes a rank). A node reads the other nodes' small keys
only while its own ranks stand still past `--hang-after` (one request for all of them every half second): a node
whose ranks moved recently keeps it from calling a hang. At a hang it reads their records, writes them in the folder "nodes" of its run folder and reads
them with its own (`hang_verdict`). The ranks' stacks stay on their node: each node's watch takes its own ranks' at
the same hang. Every two seconds each node also sets its ranks' windows of steps (`watch_windows.py`: a few hundred
bytes a rank) and reads the other nodes', so that a window is judged over every rank of the job: a node whose ranks
alone wait for their data is a straggler, not input-bound.

The store is torchrun's: keys live under `ddp-doctor/watch/{rdzv_id}/` and are gone with the job. Anything that
fails (no store yet, the store gone at the job's end) leaves the node watching its own ranks, as on one node.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ddp_doctor.core.beacon import read_beacon
from ddp_doctor.core.rankstate import write_other_nodes

__all__ = ["NodeShare"]

logger = logging.getLogger("ddp_doctor")

_PREFIX = "ddp-doctor/watch"
_CONNECT_EVERY_S = 2.0
_PUBLISH_EVERY_S = 2.0
_READ_EVERY_S = 0.5
_RECORDS_AFTER_S = 1.0
"""A node publishes its ranks' records once they have stood still this long (a hang is called much later)."""


def _store_endpoint(namespace: dict[str, Any]) -> str:
    """`host:port` of the job's store: the c10d rendezvous' endpoint, or, under the static rendezvous (torchrun's
    default, `--master-addr`/`--master-port` with `--node-rank`), the store node 0's agent hosts at the master's
    address; "" for another backend (etcd: no TCP store to join)."""
    backend = namespace.get("rdzv_backend") or "static"
    if backend == "c10d":
        return str(namespace.get("rdzv_endpoint") or "")
    if backend == "static":
        host = namespace.get("master_addr") or "127.0.0.1"
        return f"{host}:{namespace.get('master_port') or 29500}"
    return ""


class NodeShare:
    """One node's side of the shared records (the parent's `WatchLoop` calls it)."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        nnodes = str(namespace.get("nnodes", "1"))
        self._endpoint = _store_endpoint(namespace)
        self.enabled = bool(self._endpoint) and nnodes not in ("1", "1:1") and not namespace.get("standalone")
        self.several = self.enabled
        """A multi-node job: its windows are judged over every node's ranks, even once the store is gone."""
        self._prefix = f"{_PREFIX}/{namespace.get('rdzv_id') or 'none'}"
        self._store: Any = None
        self._node = 0
        self._tried = 0.0
        self._seen: dict[int, tuple[int, float, dict[str, Any]]] = {}
        """Per other node: (its publication's sequence number, when this node first read it, the publication)."""
        self._seq = 0
        self._published = self._records_at = self._read_at = 0.0
        self._windows_at = 0.0
        self._windows_sent = ""
        self._windows: dict[int, list[dict[str, Any]]] = {}
        """The other nodes' ranks' windows, as last read."""

    def _connect(self) -> bool:
        """Whether this node is connected to the job's store, trying at most every two seconds. The store's port is
        asked first with a plain socket (half a second at most): a store not up yet, or gone at the job's end, costs
        the watch no longer wait and prints none of c10d's retries."""
        if self._store is not None:
            return True
        if time.monotonic() - self._tried < _CONNECT_EVERY_S:
            return False
        self._tried = time.monotonic()
        try:
            TCPStore = _tcp_store()
            host, port = self._endpoint.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=0.5):
                pass
            from datetime import timedelta

            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
            self._node = int(store.add(f"{self._prefix}/nodes", 1))
            self._store = store
        except Exception as exc:  # noqa: BLE001  (the store not up yet, or gone: watch this node's ranks)
            logger.debug("ddp-doctor: the rendezvous store at %s is not reachable: %s", self._endpoint, exc)
            return False
        return True

    def publish(self, folder: Path, last_moved: float | None) -> None:
        """How long ago one of this node's ranks last moved (a small key the other nodes read while their own ranks
        stand still): every two seconds while they move, every half second once they have stood still for a second,
        so that a reader's estimate of when they last moved is at most a second late; and, from then on, their
        records every two seconds (read only at a hang)."""
        now = time.monotonic()
        still = None if last_moved is None else max(0.0, time.time() - last_moved)
        waiting = still is not None and still >= _RECORDS_AFTER_S
        every = _READ_EVERY_S if waiting else _PUBLISH_EVERY_S
        if not self.enabled or now - self._published < every or not self._connect():
            return
        self._published = now
        self._seq += 1
        try:
            self._store.set(f"{self._prefix}/node{self._node}/still", json.dumps({"seq": self._seq, "still_s": still}))
            if waiting and now - self._records_at >= _PUBLISH_EVERY_S:
                self._records_at = now
                self._store.set(f"{self._prefix}/node{self._node}/records", json.dumps(_records(folder), default=str))
        except Exception as exc:  # noqa: BLE001  (the job ended: the store went with it)
            logger.debug("ddp-doctor: could not publish to the rendezvous store: %s", exc)
            self.enabled = False

    def others_moved(self) -> float | None:
        """When (this node's clock) a rank on another node last moved, from their newest publications (read at most
        every half second, only while this node's ranks stand still: one request for every node's key); None when no
        other node has published."""
        now = time.monotonic()
        if self.enabled and self._store is not None and now - self._read_at >= _READ_EVERY_S:
            self._read_at = now
            try:
                count = int(self._store.add(f"{self._prefix}/nodes", 0))
                keys = [f"{self._prefix}/node{n}/still" for n in range(1, count + 1) if n != self._node]
                # One request when every node has published (the usual case); key by key when some has not yet.
                present = keys if keys and self._store.check(keys) else [k for k in keys if self._store.check([k])]
                values = self._store.multi_get(present) if present else []
                for key, raw in zip(present, values):
                    data = json.loads(bytes(raw))
                    node = int(key.rsplit("/", 2)[1][len("node") :])
                    if node not in self._seen or self._seen[node][0] != data["seq"]:
                        self._seen[node] = (data["seq"], time.time(), data)
            except Exception as exc:  # noqa: BLE001
                logger.debug("ddp-doctor: could not read the rendezvous store: %s", exc)
                self.enabled = not _gone(exc)
        moved = [
            first_read - float(d["still_s"]) for _, first_read, d in self._seen.values() if d["still_s"] is not None
        ]
        return max(moved) if moved else None

    def materialize(self, folder: Path) -> Path | None:
        """Write the other nodes' last published records in `folder`'s "nodes" (read as a run folder of their own);
        None when there are none."""
        if not self.enabled or self._store is None:
            return None
        wrote = False
        for node in self._seen:
            key = f"{self._prefix}/node{node}/records"
            try:
                if not self._store.check([key]):
                    continue
                records = json.loads(self._store.get(key))
            except Exception as exc:  # noqa: BLE001
                logger.debug("ddp-doctor: could not read node %d's records: %s", node, exc)
                continue
            write_other_nodes(folder, records)
            wrote = wrote or bool(records)
        return folder / "nodes" if wrote else None

    def windows(self, folder: Path) -> dict[int, list[dict[str, Any]]] | None:
        """Set this node's ranks' windows of steps (when they changed) and read the other nodes' (every two seconds):
        {rank: its windows}, as last read (also once the store went with the job's end); None on one node."""
        now = time.monotonic()
        if not self.several:
            return None
        if self.enabled and now - self._windows_at >= _PUBLISH_EVERY_S and self._connect():
            self._windows_at = now
            mine = {}
            for path in sorted((folder / "windows").glob("rank*.json")):
                try:
                    mine[path.stem[len("rank") :]] = json.loads(path.read_text()).get("windows", [])
                except (OSError, ValueError):
                    continue
            text = json.dumps(mine)
            try:
                if text != self._windows_sent:
                    self._store.set(f"{self._prefix}/node{self._node}/windows", text)
                    self._windows_sent = text
                count = int(self._store.add(f"{self._prefix}/nodes", 0))
                for n in range(1, count + 1):
                    key = f"{self._prefix}/node{n}/windows"
                    if n != self._node and self._store.check([key]):
                        for rank, rows in json.loads(self._store.get(key)).items():
                            self._windows[int(rank)] = rows
            except Exception as exc:  # noqa: BLE001  (the job ended: the store went with it)
                logger.debug("ddp-doctor: could not share the windows through the rendezvous store: %s", exc)
                self.enabled = False
        return dict(self._windows)


def _tcp_store() -> Any:
    """torch's `TCPStore`, imported before the store's port is asked (the first import takes seconds, in which a
    short job's store can go). Where this process imports torch here first, c10's C++ log level is set to FATAL for
    it alone (read once, at the import; the job's processes are started with the environment as it was): a client
    whose store went with the job's end would print a wall of connection retries with C++ frames otherwise."""
    if "torch" in sys.modules:
        from torch.distributed import TCPStore

        return TCPStore
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        from torch.distributed import TCPStore
    finally:
        if before is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = before
    return TCPStore


def _gone(exc: Exception) -> bool:
    """The store's host went away (its agent ended with its node's job): talk to it no more, so that c10d's
    warning of a closed connection is printed once, not at every look."""
    return type(exc).__name__ == "DistNetworkError" or isinstance(exc, (ConnectionError, OSError))


def _records(folder: Path) -> dict[str, Any]:
    """This node's ranks' files, by name: each beacon's state, each sampled line and end record as written."""
    records: dict[str, Any] = {}
    for path in folder.glob("rank*.beacon"):
        state = read_beacon(path)
        if state is not None:
            records[path.name] = state.to_dict()
    for path in folder.glob("rank*.json"):
        try:
            records[path.name] = path.read_text()
        except OSError:
            continue
    return records
