"""Every detector of the `Summary`, in the order their findings appear in the report. A detector registers itself
where it is written (`@detects(Code.X)`, `analyze/view.py`); importing its family module here is what registers it,
and `core/codes.py`'s `REPORT_ORDER` says where its findings read among the others."""

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
    in_graph,
    moves,
    optimizer_settings,
    passes,
    replica_state,
    shapes,
    shards,
    throughput,
    tree_state,
    used_set,
    weight_writes,
)
from ddp_doctor.analyze.view import Detector, detectors

__all__ = ["DETECTORS"]

DETECTORS: tuple[Detector, ...] = tuple(fn for _, fn in detectors())
