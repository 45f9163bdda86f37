"""How a rank ended, told to the ranks of the other nodes through the job's store.

Each node's run folder holds its own ranks' files. On several nodes, a rank whose collective fails because a peer
on another node went away (gloo's *Connection closed by peer*) would be all its node's report could name: the rank
that noticed, not the one that left. So a rank that ends (its script returned, called `sys.exit` or raised) first
sets its end record and its beacon in the process group's store (torchrun's, hosted by an agent that outlives the
rank), then exits and closes its connections; a rank that then loses a peer reads what the other nodes' ranks left
there and writes it in its run folder's "nodes" folder, which `rankstate.read_rank_states` reads beside the folder's
own files (the folder `watch_nodes.NodeShare` writes at a hang).

The store is asked at most twice per rank, at its end, from a thread given two seconds: a store gone with its
agent, or one that does not answer, costs the rank no more. A rank killed by a signal leaves nothing here. One node:
nothing is shared (the folder holds every rank's files).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from ddp_doctor.core.beacon import BeaconState
from ddp_doctor.core.rankstate import write_other_nodes

__all__ = ["receive", "share", "several_nodes"]

logger = logging.getLogger("ddp_doctor")

_KEY = "ddp-doctor/ends"
_MAX_RECORDS = 64
"""The most records a rank reads back (the first ranks to end: the ones a failure is about)."""
_WAIT_S = 2.0


def several_nodes() -> bool:
    """Whether this rank's job spans more than its node (torchrun's `LOCAL_WORLD_SIZE` below `WORLD_SIZE`)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return 0 < local < int(os.environ.get("WORLD_SIZE", "1") or 1)


def _store() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def _within(seconds: float, work: Any) -> Any:
    """`work()`'s result, or None when it raised or took longer than `seconds` (it is then left in a daemon
    thread: the rank exits without it)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except Exception as exc:  # noqa: BLE001  (the store gone with its agent: nothing to share)
            logger.debug("ddp-doctor: the job's store did not answer: %s", exc)

    thread = threading.Thread(target=run, name="ddp-doctor-ends", daemon=True)
    thread.start()
    thread.join(seconds)
    return out[0] if out else None


def share(rank: int, end: dict[str, Any], beacon: BeaconState) -> None:
    """Set this rank's end record and beacon in the job's store (several nodes only)."""
    store = _store() if several_nodes() else None
    if store is None:
        return
    payload = json.dumps({"end": end, "beacon": beacon.to_dict()}, default=str)

    def put() -> bool:
        store.set(f"{_KEY}/{rank}", payload)
        store.append(_KEY, f"{rank},")
        return True

    _within(_WAIT_S, put)


def receive(folder: Path, rank: int) -> list[int]:
    """Write the records other ranks left in the job's store in `folder`'s "nodes" (ranks whose files `folder`
    lacks: the other nodes'); the ranks written."""
    store = _store() if several_nodes() else None
    if store is None:
        return []

    def get() -> dict[int, dict[str, Any]]:
        if not store.check([_KEY]):
            return {}
        listed = bytes(store.get(_KEY)).decode().split(",")
        ranks = [r for r in dict.fromkeys(int(x) for x in listed if x.strip().isdigit()) if r != rank]
        ranks = [r for r in ranks if not (folder / f"rank{r}.json").exists()][:_MAX_RECORDS]
        values = store.multi_get([f"{_KEY}/{r}" for r in ranks]) if ranks else []
        return {r: json.loads(bytes(v)) for r, v in zip(ranks, values)}

    records = _within(_WAIT_S, get) or {}
    for r, record in records.items():
        write_other_nodes(folder, {f"rank{r}.json": record["end"], f"rank{r}.beacon": record["beacon"]})
    return sorted(records)
