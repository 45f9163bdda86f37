"""Round E of the check's exchange: the strings the report quotes (sites, messages, logged calls), from group rank 0
and a bounded set of example ranks per predicate, whatever the world size."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import torch

from ddp_doctor.core.codes import Code
from ddp_doctor.core.records import RankRecord
from ddp_doctor.core.summary import Examples
from ddp_doctor.exchange.compared import FirstSteps
from ddp_doctor.exchange.packing import Op, Reply, from_words, to_words

__all__ = ["as_of", "at_step", "changing_buffers", "example_metas", "rank_strings"]

QUOTED = (
    "crashed",
    "bypass-sites",
    "blocked-sites",
    "extra-passes",
    "unpaired-extra",
    "broadcast-extra",
    "collective-differs",
    "scale-differs",
    Code.OPTIMIZER_DIFFERS,
    "skipped-step",
    "changed-outside",
    "rereduced",
    "scheduler-extra",
    "grads-edited",
    "state-differs",
)
"""The predicates whose example ranks send their strings (all of them); `fewest-batches` and `sampler-apart` send
their first example's (other than rank 0, for `sampler-apart`), `same-path-save` its first `SAVERS_QUOTED`'."""
SAVERS_QUOTED = 4
"""The ranks that wrote a path other ranks wrote too whose strings (each save's machine and local rank) are sent:
enough to tell one machine from several and a guard on the local rank from none."""


def at_step(log: list[str], step: int | None) -> list[str]:
    """The entries of a per-step log (`step N: text`) for `step`, without the prefix ([] for None)."""
    if step is None:
        return []
    prefix = f"step {step}: "
    return [entry.removeprefix(prefix) for entry in log if entry.startswith(prefix)]


def as_of(log: list[dict[str, Any]], step: int | None) -> dict[str, Any] | None:
    """The last entry of a log of changes (each with its `step`) at or before `step`."""
    if step is None:
        return None
    found = None
    for entry in log:
        if entry["step"] > step:
            break
        found = entry
    return found


def rank_strings(
    record: RankRecord,
    first: FirstSteps,
    *,
    window_sites: list[str],
    shared_saves: list[dict[str, Any]],
    scale: int,
    edited: int | None = None,
) -> bytes:
    """What this rank would quote (JSON): its crash, sites, loaders, and its per-step logs at the first step where
    the ranks differ in each (`first`; `edited`: the first step in which this rank changed gradients after DDP
    reduced them)."""
    unpaired, broadcast, collective, settings = first.unpaired, first.broadcast, first.collective, first.settings
    sched, changed, skip, rereduced = first.sched, first.changed, first.skip, first.rereduced
    measured = record.counter("grads_measured").tolist()
    return json.dumps(
        {
            "crash_kind": record.crash_kind,
            "crash_step": record.crash_step,
            "crash_message": record.crash_message,
            "crash_site": record.crash_site,
            "bypass_sites": sorted(set(record.bypass_sites)),
            "blocked_checkpoints": sorted(set(record.blocked_checkpoints)),
            "loaders": record.loaders,
            "window_sites": window_sites,
            "unpaired_sites": at_step(record.unpaired_sites, unpaired),
            "broadcast_sites": at_step(record.broadcast_sites, broadcast),
            "collective_log": at_step(record.collective_log, collective),
            "scale": scale,
            "optimizer": at_step(record.optimizer_log, settings),
            "scheduler_sites": at_step(record.scheduler_sites, sched),
            "metric_schedulers": record.metric_schedulers,
            "changed_sites": at_step(record.changed_sites, changed),
            # A skipped step shows at the next one: the forward that came without a step.
            "skip_sites": at_step(record.repeat_sites, skip + 1) if skip is not None else [],
            "step_sites": record.step_sites if skip is not None else [],
            "changed_params": record.changed_params if changed is not None else [],
            "rereduce_sites": at_step(record.rereduce_sites, rereduced),
            "pass_sites": record.pass_sites,
            "split_params": record.split_params,
            "shared_saves": shared_saves,
            "module_saves": [d for d in record.saves if d.get("module_prefix")][:1],
            "grad_edit_sites": at_step(record.grad_edit_sites, edited),
            "edited_step": edited,
            "nosync_sites": record.nosync_sites,
            "grads_measured": {k: measured.count(i) for i, k in enumerate(("backward", "step", "closure"))},
            "state": as_of(record.state_log, first.state),
            "state_log": record.state_log[:4],
            "unregistered": record.unregistered,
            "orphaned": record.orphaned,
            "retied": record.retied,
            "recast": record.recast,
            "recast_count": record.recast_count,
            "late_buffers": record.late_buffers,
            "late_count": record.late_count,
            "unreadable": record.unreadable,
            "join_sites": record.join_sites,
            "join_throws": record.join_throws,
            "optimizer_stale": record.optimizer_stale,
            "outside": record.outside,
            "outside_count": record.outside_count,
            "comm_hook": record.comm_hook,
            "modules": record.modules,
            "nonfinite_params": record.nonfinite_params,
            "never_updated": record.never_updated,
            "never_updated_held": record.never_updated_held,
            "never_updated_zero_lr": record.never_updated_zero_lr,
            "learning_rates": record.learning_rates,
            "to_empty_sites": record.to_empty_sites,
            "graph_collectives": record.graph_collectives,
            "model_averaging": record.model_averaging,
            "beside_modules": record.beside_modules,
            "buffers_changing": changing_buffers(record.buffer_fp),
        }
    ).encode()


def changing_buffers(buffer_fp: torch.Tensor) -> list[int]:
    """Positions of the buffers whose fingerprint changed between this rank's observed steps (`[S, B, 2]`; steps
    without a training forward are NaN): running statistics, not values made once (at most 64)."""
    seen = buffer_fp[~buffer_fp.isnan().any(-1).any(-1)]
    if seen.shape[0] < 2:
        return []
    return (seen != seen[:1]).any(-1).any(0).nonzero().flatten().tolist()[:64]


def example_metas(
    examples: dict[str, Examples], meta: bytes, n_meta: int, *, rank: int
) -> Generator[Op, Reply, dict[int, dict[str, Any]]]:
    """Each chosen rank's `meta` (its JSON, `n_meta` bytes at most on any rank), by rank. One collective."""
    wanted = {0}
    for name in QUOTED:
        wanted.update(examples[name].ranks)
    wanted.update(examples["fewest-batches"].ranks[:1])
    wanted.update(examples["same-path-save"].ranks[:SAVERS_QUOTED])
    wanted.update([r for r in examples["sampler-apart"].ranks if r][:1])
    chosen = sorted(wanted)  # at most 2 + SAVERS_QUOTED + 15 * EXAMPLES ranks
    words = -(-n_meta // 8)
    e = torch.zeros(len(chosen), words, dtype=torch.int64)
    if rank in chosen:
        e[chosen.index(rank)] = to_words(meta, words)
    got = yield ("sum", e.reshape(-1))
    rows = got.tensor.reshape(len(chosen), words)
    return {r: json.loads(from_words(rows[i], n_meta).rstrip(b"\0").decode()) for i, r in enumerate(chosen)}
