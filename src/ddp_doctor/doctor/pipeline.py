"""The pipeline after the observed steps: the exchange -> analyze (pure) -> the report object; and `analyze`, the
same pipeline in one process over every rank's records (the exchange's in-process model)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddp_doctor.analyze import analyze_summary
from ddp_doctor.core.findings import Diagnosis
from ddp_doctor.core.records import ModelInfo, RankRecord
from ddp_doctor.exchange.runner import exchange
from ddp_doctor.exchange.simulate import summarize
from ddp_doctor.report import Report, RunFacts

__all__ = ["analyze", "diagnose"]


def analyze(info: ModelInfo, records: Sequence[RankRecord]) -> Diagnosis:
    """Diagnose every rank's records in this process, no process group needed.

    The records are reduced exactly as the ranks' exchange reduces them (`ddp_doctor.exchange.summarize`), then
    diagnosed by `ddp_doctor.analyze.analyze_summary`.

    Args:
        info: the model as DDP wrapped it (rank 0's view).
        records: one `RankRecord` per rank, in rank order.

    Returns:
        A `Diagnosis`: findings (errors first), the recommendation, per-step timing and any crashes.
    """
    return analyze_summary(summarize(info, records))


def diagnose(
    record: RankRecord,
    info: ModelInfo,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float,
    tag: str,
) -> Report:
    """Reduce `record` with the other ranks of `group` (`ddp_doctor.exchange.runner.exchange`) and diagnose the
    group. Collective over `group`.

    Args:
        record: this rank's observations.
        info: the model as this rank wrapped it.
        group: the DDP model's process group (each DDP model is compared within its own group).
        device: where the exchange's tensors live (`ddp_doctor.exchange.primitives.comm_device`).
        timeout: seconds to wait for the other ranks to arrive.
        tag: the exchange's name in the store, equal on every rank and unique per exchange.

    Returns:
        The `Report`, identical on every rank of `group`.
    """
    summary = exchange(record, info, timeout=timeout, tag=tag, device=device, group=group)
    facts = RunFacts.of_model(summary.info, world_size=summary.world, backend=str(dist.get_backend(group)))
    return Report.build(facts, analyze_summary(summary))
