"""What a sharded model's report compared across the ranks, with counts, and what it did not check: the claim a
report about FSDP2 or `replicate` may make, and its limits said (`Diagnosis.compared`, `Diagnosis.unchecked`). Pure:
the agreed facts (`ShardedRun`) in. DDP's counterpart is `analyze/coverage.py`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ddp_doctor.analyze.coverage import not_read
from ddp_doctor.core.codes import not_checked_for
from ddp_doctor.core.findings import Unchecked
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of
from ddp_doctor.core.steptime import MIN_STEPS

__all__ = ["sharded_compared", "sharded_unchecked"]


def _untimed(run: ShardedRun) -> list[Unchecked]:
    """The step-time checks not made."""
    if run.timed_steps < MIN_STEPS:
        text = f"the step time (timed over at least {MIN_STEPS} steps after the first, on CPU or one GPU a rank)"
        return [Unchecked("step-time", text, {"timed_steps": run.timed_steps, "needed": MIN_STEPS})]
    if run.gpu_timed:
        text = "a straggler rank (on a GPU the time in the collectives is not timed: NCCL runs them on its streams)"
        return [Unchecked("straggler", text, {"why": "gpu"})]
    if not run.comm_timed:
        text = "a straggler rank (the time in the sharded model's collectives could not be timed)"
        return [Unchecked("straggler", text, {"why": "collectives-untimed"})]
    return []


def sharded_compared(run: ShardedRun) -> dict[str, Any]:
    """What the sharded report compared across the ranks, with counts (`Diagnosis.compared`, drawn by report/):
    every item is a value reduced over every rank (`doctor/sharded_report.py`), nothing more."""
    timed = run.timed_steps >= MIN_STEPS
    fully_shard = parallelism_of(run.sharding) == "fsdp2"
    return {
        "parallelism": parallelism_of(run.sharding),
        "api": "fully_shard" if fully_shard else "replicate",
        "ranks": run.world,
        "steps": run.steps,
        "parameters": run.model_params,
        "outside_groups": len(run.unsharded) - sum(run.outside_model),
        "outside_model": sum(run.outside_model),
        "replicas": run.replicas_compared,
        "replica_rows": run.replica_rows,
        "buffers": run.buffers_compared,
        "inputs": len(run.inputs_compared),
        "inputs_within_groups": len(run.beside_compared),
        "group_dims": run.beside_dims,
        "batches_drawn": run.state_steps if run.loader_compared else 0,
        "samplers": run.samplers_compared,
        "state_steps": run.state_steps,
        "modules": run.modules if run.state_steps else 0,
        "collectives": run.script_collectives if run.state_steps else None,
        "gradient_scale_steps": len(run.scale_steps),
        "saves": ("the observed steps and the epoch end followed" if run.followed else "the observed steps")
        if fully_shard
        else None,
        "timed_steps": run.timed_steps if timed else 0,
        "clock": ("gpu" if run.gpu_timed else "host") if timed else None,
        "straggler": timed and run.comm_timed and not run.gpu_timed and run.world > 1,
        "all_gathers_per_step": run.sharding.get("all_gathers_per_step") if fully_shard else None,
        "codes_not_checked": [str(c) for c in not_checked_for(parallelism_of(run.sharding))],
    }


def _replicas_unchecked(run: ShardedRun, name: str) -> list[Unchecked]:
    """What the replicas' comparison (`replicas_compared`) left out: a write to the weights on some ranks is seen
    only where a copy to compare with exists, and only as of the last observed step."""
    if run.world < 2:
        return []
    if run.replicas_compared:
        text = (
            f"{name}: the step between the first and the last observed one at which the replicas' weights parted "
            "(they are compared at those two)"
        )
        return [Unchecked("replicas-parting-step", text)]
    if run.replica_rows > 0:  # the ranks hold more replica rows than the exchange compares
        text = f"{name}: the replicas' weights ({run.replica_rows} shards each held by several ranks)"
        return [Unchecked("replicas", text, {"shards": run.replica_rows})]
    text = (
        f"{name}: writes to the weights outside the optimizer on some ranks (each shard is held once: there is "
        "no copy to compare it with)"
    )
    return [Unchecked("weights-written-some-ranks", text)]


_BESIDE = (
    "the weights of modules the script runs beside the model (a distillation teacher, a frozen encoder): DDP's "
    "check compares them across the ranks, this one does not yet"
)


def sharded_unchecked(run: ShardedRun) -> list[Unchecked]:
    """What the sharded report did not check (`Diagnosis.unchecked`): its own gaps, and DDP's checks it has no
    counterpart of yet, said rather than left out. Each says the parallelism (`facts["parallelism"]`)."""
    parallelism = parallelism_of(run.sharding)
    after = "after the epoch end followed" if run.followed else "after the observed steps"
    since = {"after": "epoch-end" if run.followed else "observed-steps"}
    # A step some ranks skip within the observed steps stops the check there (`optimizer-step-skipped`).
    skipped = f"optimizer steps skipped on some ranks {after}"
    if parallelism == "replicate":
        out = [
            Unchecked("mixed-precision", "the mixed-precision policy of replicate"),
            *_untimed(run),
            Unchecked("optimizer-steps-skipped", f"replicate: {skipped}", since),
            *_replicas_unchecked(run, "replicate"),
            Unchecked("modules-beside", f"replicate: {_BESIDE}"),
        ]
    else:
        who = "`ddp-doctor check` names them when they do" if run.in_process else "they are named when they do"
        some = f"FSDP2: forwards and full-state-dict gathers on some ranks only that did not break the run ({who})"
        unread = [f"buffer {b}" for b in run.buffers_unreadable]
        out = [
            Unchecked("sharded-saves", f"FSDP2: a save of sharded state {after}", since),
            Unchecked("calls-some-ranks", some, {"in_process": run.in_process}),
            Unchecked(
                "mixed-precision",
                "FSDP2: the mixed-precision policy beyond the dtype of the gradients' reduce-scatter and of the "
                "weights the optimizer steps",
            ),
            *_untimed(run),
            Unchecked("optimizer-steps-skipped", f"FSDP2: {skipped}", since),
            *_replicas_unchecked(run, "FSDP2"),
            Unchecked("modules-beside", f"FSDP2: {_BESIDE}"),
            *_beside_mesh(run),
            *([Unchecked("unreadable", "FSDP2: " + not_read(unread), {"tensors": unread})] if unread else []),
        ]
    return [dataclasses.replace(u, facts={**u.facts, "parallelism": parallelism}) for u in out]


def _beside_mesh(run: ShardedRun) -> list[Unchecked]:
    """A mesh smaller than the world (tensor parallelism beside FSDP2): the ranks of one tensor-parallel group must
    read the same batches, and their inputs are compared only across every rank, not within those groups."""
    size = run.sharding.get("mesh_size")
    if not size or size >= run.world:
        return []
    where = f"FSDP2 on a {size}-rank mesh beside another dimension of the {run.world}-rank world"
    mesh = {"mesh_size": size, "world": run.world}
    if run.beside_compared:  # the groups' inputs were compared (`beside_inputs`): the samplers' own ranks are not
        return [
            Unchecked(
                "sampler-rank-beside-mesh",
                f"{where}: whether each rank's sampler holds its own data-parallel rank",
                mesh,
            )
        ]
    text = (
        f"{where} (tensor parallelism, say): whether the ranks that differ only along that dimension read the same "
        "batches (their parameters are not on one mesh of both), and whether each rank's sampler holds its own "
        "data-parallel rank"
    )
    return [Unchecked("inputs-beside-mesh", text, mesh)]
