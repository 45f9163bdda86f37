"""Every detector, of the `Agreed` facts every parallelism gives, of DDP's `Summary` and of a sharded model's
`ShardedRun`, in the order their findings appear in the report. A detector registers itself where it is written
(`@detects(Code.X, road="every")`, `@detects(Code.X)` or `@detects(Code.X, road="sharded")`, `analyze/view.py`);
importing its family module here is what registers it, and `core/codes.py`'s `REPORT_ORDER` says where its findings
read among the others."""

from __future__ import annotations

from ddp_doctor.analyze import (  # noqa: F401 (imported to register their detectors)
    agreement,
    buffer_state,
    causes,
    checkpoints,
    collective_order,
    consistency,
    crashed_ranks,
    epochs,
    frozen_set,
    hidden_use,
    in_graph,
    moves,
    optimizer_settings,
    passes,
    replica_state,
    shapes,
    sharded,
    sharded_saves,
    shards,
    stragglers,
    throughput,
    tree_state,
    unsharded,
    used_set,
    weight_writes,
)
from ddp_doctor.analyze.view import Detector, detectors

__all__ = ["DETECTORS", "SHARDED_DETECTORS"]

DETECTORS: tuple[Detector, ...] = tuple(fn for _, fn in detectors())
"""DDP's: each a function of a `View`, or of the `Agreed` facts it gives."""
SHARDED_DETECTORS: tuple[Detector, ...] = tuple(fn for _, fn in detectors("sharded"))
"""A sharded model's (FSDP2's `fully_shard`, `replicate`): each a function of a `ShardedRun`, or of the `Agreed`
facts it gives."""
