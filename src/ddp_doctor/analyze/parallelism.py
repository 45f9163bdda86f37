"""The parallelism as an input to the rules of a sharded model's facts (`ShardedRun`): how a finding names the call
that built the model (FSDP2's `fully_shard`, or the FSDP2-based `replicate`), the ranks and the observed steps a
finding covers, and what was measured of the weights' moves. Every detector registered with ``road="sharded"``
(`analyze/view.py`'s `detects`) reads them here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddp_doctor.core.agreed import HeldApart
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = [
    "FULLY_SHARD",
    "REPLICATE",
    "Api",
    "api_for",
    "api_of",
    "apart_args",
    "every_rank",
    "moved_words",
    "frozen_apart",
    "train_modes_apart",
    "observed_steps",
    "optimizer_named",
    "unchanged",
]


@dataclass(frozen=True, slots=True)
class Api:
    """How a finding names the call that built the model: FSDP2's `fully_shard`, or the FSDP2-based `replicate`
    (the same replaced parameters and groups, each rank holding whole parameters and all-reducing gradients)."""

    call: str
    done: str
    holds: str
    reduces: str
    job: str
    name: str
    after: str


FULLY_SHARD = Api(
    "fully_shard",
    "sharded",
    "holding this rank's shard",
    "reduce-scatters",
    "shards its model with FSDP2 (fully_shard)",
    "FSDP2",
    "sharding",
)
REPLICATE = Api(
    "replicate",
    "replicated",
    "(a whole copy on every rank)",
    "all-reduces",
    "replicates its model with FSDP2's replicate",
    "replicate",
    "replicate",
)


def api_of(run: ShardedRun) -> Api:
    """The call that built `run`'s model."""
    return api_for(parallelism_of(run.sharding))


def api_for(parallelism: str) -> Api:
    """The call that built a sharded model of `parallelism` (`fsdp2` or `replicate`)."""
    return REPLICATE if parallelism == "replicate" else FULLY_SHARD


def every_rank(run: ShardedRun) -> list[int]:
    """The ranks a finding of the whole job names: all of them (the facts were reduced over every rank)."""
    return list(range(run.world))


def observed_steps(run: ShardedRun) -> list[int]:
    """The observed optimizer steps."""
    return list(range(run.steps))


def optimizer_named(run: ShardedRun) -> str:
    """The followed optimizer, with the line that created it where it is known."""
    return f"{run.optimizer} created at {run.optimizer_site}" if run.optimizer_site else run.optimizer


def unchanged(run: ShardedRun) -> str:
    """What was measured of the model's weights between the first observed step and the last, as a sentence."""
    return moved_words(steps=run.steps, moved=run.model_changed, model_params=run.model_params)


def moved_words(*, steps: int, moved: bool, model_params: int) -> str:
    """Whether any of the model's `model_params` trainable parameters `moved` over `steps` observed optimizer
    steps, as a sentence."""
    if steps < 2:
        return "Only one optimizer step was observed, so whether the weights change was not measured."
    if moved:
        return f"Some of the model's weights did change between the first and the last of the {steps} steps."
    return (
        f"Measured: between the first and the last of the {steps} observed optimizer steps, not one of the "
        f"model's {model_params} trainable parameters changed on any rank."
    )


def apart_args(apart: HeldApart) -> dict[str, Any]:
    """The arguments of a rule over what the ranks held apart at a step (the optimizer's settings, the modules'
    modes): the step, each shown rank's value, the reference rank, and the ranks named (the reference among
    them)."""
    return {"step": apart.step, "held": apart.held, "reference": apart.reference, "ranks": apart.named}


def frozen_apart(modes: HeldApart | None) -> bool:
    """Whether the ranks' modes entries (`tree_scan.modes_of`, as `ShardedRun.modes_apart` holds them) differ in
    which parameters require a gradient."""
    entries = modes.held.values() if modes is not None else ()
    return len({(tuple(e.get("frozen") or []), e.get("frozen_count", 0)) for e in entries}) > 1


def train_modes_apart(modes: HeldApart | None) -> bool:
    """Whether they differ in the modules' train/eval modes."""
    entries = modes.held.values() if modes is not None else ()
    keys = {(e.get("training"), tuple(e.get("other_mode") or []), e.get("other_mode_count")) for e in entries}
    return len(keys) > 1
