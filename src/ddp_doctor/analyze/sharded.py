"""Findings of a job that shards with FSDP2 (`fully_shard`): `optimizer-params-replaced`,
`unsharded-params-not-synced`, `gradient-sync-off`, `sharded-checkpoint-incomplete`, and DDP's `unused-parameters`. Pure: the agreed facts
(`ShardedRun`) in, findings out.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_train.py`, 12 steps): each of
the three mistakes runs to the end with exit code 0 and prints nothing. The optimizer built before `fully_shard`,
and gradient sync never switched back on, change no weight at all; a root left unsharded trains its head apart on
each rank (its weight sums end at -2.187 and -2.443). Rank 0 alone calling `torch.save(model.state_dict(), path)`
also ends with exit code 0: the file holds DTensors with rank 0's shard (a [32, 16] local tensor of a [64, 16]
weight), and loading it into the unsharded model raises *aten.copy_.default got mixed torch.Tensor and DTensor*.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ddp_doctor.analyze.agreement import beside_inputs_apart, same_inputs
from ddp_doctor.analyze.causes import shards_scaled_apart
from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.epochs import drawn_apart
from ddp_doctor.analyze.in_graph import in_graph_findings
from ddp_doctor.analyze.sharded_fixes import optimizer_fix, sync_fix
from ddp_doctor.analyze.sharded_saves import incomplete_checkpoint
from ddp_doctor.analyze.sharded_state import buffer_divergence, low_precision_weights, replica_state, training_moves
from ddp_doctor.analyze.sharded_timing import sharded_input_bound, sharded_straggler
from ddp_doctor.analyze.shards import samplers_apart
from ddp_doctor.analyze.tree_state import stale_optimizer
from ddp_doctor.analyze.unsharded import unsharded_finding
from ddp_doctor.analyze.used_set import unused_finding
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Recommendation, lines_of
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = ["sharded_findings", "sharded_recommendation", "verified_reshard"]


@dataclass(frozen=True, slots=True)
class _Api:
    """How a finding names the call that built the model: FSDP2's `fully_shard`, or the FSDP2-based `replicate`
    (the same replaced parameters and groups, each rank holding whole parameters and all-reducing gradients)."""

    call: str
    done: str
    holds: str
    reduces: str
    job: str
    name: str
    after: str


_FULLY_SHARD = _Api(
    "fully_shard",
    "sharded",
    "holding this rank's shard",
    "reduce-scatters",
    "shards its model with FSDP2 (fully_shard)",
    "FSDP2",
    "sharding",
)
_REPLICATE = _Api(
    "replicate",
    "replicated",
    "(a whole copy on every rank)",
    "all-reduces",
    "replicates its model with FSDP2's replicate",
    "replicate",
    "replicate",
)


def _api(run: ShardedRun) -> _Api:
    return _REPLICATE if run.sharding.get("api") == "replicate" else _FULLY_SHARD


def _steps(run: ShardedRun) -> list[int]:
    return list(range(run.steps))


def _unchanged(run: ShardedRun) -> str:
    if run.steps < 2:
        return "Only one optimizer step was observed, so whether the weights change was not measured."
    if run.model_changed:
        return f"Some of the model's weights did change between the first and the last of the {run.steps} steps."
    return (
        f"Measured: between the first and the last of the {run.steps} observed optimizer steps, not one of the "
        f"model's {run.model_params} trainable parameters changed on any rank."
    )


def sharded_findings(run: ShardedRun) -> list[Finding]:
    """Every FSDP2 finding the facts support, errors first."""
    ranks = list(range(run.world))
    where = f"{run.optimizer} created at {run.optimizer_site}" if run.optimizer_site else run.optimizer
    api = _api(run)
    found: list[Finding] = []
    if run.replaced and not run.model_params_stepped:
        found.append(
            stale_optimizer(
                stale=run.replaced,
                params=[],
                ranks=ranks,
                steps=_steps(run),
                wrapper=(api.call, api.holds),
                optimizer=where,
                model_params=run.model_params,
                measured=_unchanged(run),
                fix=optimizer_fix(run.framework, api.call, api.done),
            )
        )
    if run.sync_off_steps and run.sync_off_steps >= run.steps:
        site = f" (last switched off at {run.sync_off_site})" if run.sync_off_site else ""
        what = (  # set_requires_all_reduce: HSDP's switch for the replicas
            f"{api.name} then reduce-scatters the gradients within each replica and keeps them aside for the "
            "all-reduce across the replicas that never comes"
            if run.sync_off_call == "set_requires_all_reduce"
            else f"{api.name} then {api.reduces} no gradient"
        )
        found.append(
            Finding(
                code=Code.GRADIENT_SYNC_OFF,
                severity="error",
                title=f"gradient sync was off at all {run.steps} optimizer steps",
                detail=f"{run.sync_off_call}(False){site} was in force every time the optimizer stepped, and it was "
                f"never switched back on: {what}, the {api.done} parameters get no gradient, and the optimizer skips "
                "them. " + _unchanged(run),
                ranks=ranks,
                steps=_steps(run),
                sites=lines_of(run.sync_off_site or ""),
                fix=sync_fix(run.framework, run.sync_off_call),
            )
        )
    if run.shard_save:
        found.append(incomplete_checkpoint(run))
    if run.unused and run.model_params_stepped:
        found.append(_unused(run, ranks, api))
    if run.low_reduce and run.model_params_stepped:
        found.append(_low_reduce(run, ranks))
    if low_weights := low_precision_weights(run, ranks):
        found.append(low_weights)
    if scaled := shards_scaled_apart(run, ranks):
        found.append(scaled)
    found += replica_state(run)
    explained = any(f.code in (Code.OPTIMIZER_PARAMS_REPLACED, Code.GRADIENT_SYNC_OFF) for f in found)
    if not explained and (moves := training_moves(run, ranks, low_weights=low_weights is not None)):
        found.append(moves)
    if run.unsharded and (outside := unsharded_finding(run, ranks, api)):
        found.append(outside)
    found += buffer_divergence(run, ranks)
    found += in_graph_findings(run.graph_collectives, ranks=[0], wrapper=api.name)
    if run.world > 1 and run.inputs_compared and run.inputs_identical and run.beside_groups != 1:
        # (one data-parallel group beside tensor parallelism: every rank rightly reads the same batches)
        found.append(same_inputs(world=run.world, steps=run.inputs_compared))
    if run.beside_apart is not None:
        found.append(beside_inputs_apart(run.beside_apart, groups=run.beside_groups, compared=len(run.beside_compared)))
    if run.samplers_apart:
        held = {int(r): d for r, d in run.samplers_apart["held"].items() if d}
        overlap = samplers_apart(held, world=run.world, ranks=run.samplers_apart["ranks"])
        if overlap is not None:
            found.append(with_more(overlap, run.samplers_apart["more"]))
    if (apart := run.drawn_apart) is not None:
        held = {int(r): v for r, v in apart["held"].items()}  # rank -> (batches drawn, the loader's line)
        odd = apart["ranks"]  # never empty: the ranks whose count is not the reference rank's
        (others, site), (drew, _) = held[apart["reference"]], held[odd[0]]
        found.append(
            drawn_apart(
                step=apart["step"],
                ranks=odd,
                more=apart["more"],
                drew=drew,
                others=others,
                site=site,
                parallelism=parallelism_of(run.sharding),
            )
        )
    if run.input_wait:
        found.append(sharded_input_bound(run, ranks))
    if straggler := sharded_straggler(run):
        found.append(straggler)
    return found


def _low_reduce(run: ShardedRun, ranks: list[int]) -> Finding:
    low, weights = run.low_reduce or ("bfloat16", "float32")
    step = {"bfloat16": "0.0039 (2^-8)", "float16": "0.00049 (2^-11)"}.get(low, "")
    policy = ", ".join(f"{k}={'/'.join(run.sharding.get(k) or []) or 'unset'}" for k in ("param_dtype", "reduce_dtype"))
    return Finding(
        code=Code.LOW_PRECISION_REDUCE,
        severity="info",
        title=f"gradients are reduced in {low} while the weights train in {weights}",
        detail=f"FSDP2 reduce-scattered this run's gradients in {low} (seen at its reduce-scatter, on every rank), "
        f"while the sharded weights the optimizer steps are {weights}: each gradient is summed over the ranks in "
        f"{low} before the optimizer sees it. The mixed-precision policy: {policy} (with reduce_dtype unset, torch "
        "2.13 reduces in param_dtype, 2.15 in the weights' dtype). Measured on the second observed step, every "
        f"rank's reduce-scatter against a float32 one of the same inputs: the reduced gradients differ by "
        f"{run.low_reduce_rel:.2g} of their size on average (the sum of the differences over the sum of the "
        f"magnitudes), by {run.low_reduce_abs:.3g} at most in one element; {low}'s relative step is {step}. That is "
        f"the summation's own rounding on {run.world} ranks, and it grows with the number of ranks. It may be what "
        f"you meant (it halves the reduce-scatter's bytes); recipes that compute in {low} usually reduce in float32 "
        "(torchtitan's default).",
        ranks=ranks,
        fix="reduce in float32 and keep computing in the low dtype: `MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32)` in every fully_shard call (the reduce-scatter then moves twice the bytes). "
        'With Accelerate (whose mixed_precision="bf16" sets both to bfloat16): '
        "`FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=MixedPrecisionPolicy("
        "param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`.",
    )


def _unused(run: ShardedRun, ranks: list[int], api: _Api) -> Finding:
    carried = (
        "the all-gathers of their fully_shard group still carry them in every forward"
        if api is _FULLY_SHARD
        else "every rank still holds a whole copy of them"
    )
    return unused_finding(
        list(run.unused),
        steps=f"every one of the {run.steps} observed optimizer steps with gradient sync on",
        seen=": nothing in the loss reaches them",
        effect=f"{api.name} raises no error for them, unlike DDP with default flags; they do not train, and "
        f"{carried}. If a later phase of the script uses them (a curriculum, an auxiliary loss switched on later), "
        "nothing is wrong.",
        severity="warning",
        ranks=ranks,
        step_list=_steps(run),
        fix=f"remove them from the model if nothing uses them, or set requires_grad=False on them before {api.call} "
        "(and build the optimizer from the trainable parameters) while they are not used.",
    )


def sharded_recommendation(run: ShardedRun, *, errors: bool = False) -> Recommendation:
    """No DDP flags for a sharded model: what the check can say about the sharding instead, and the one
    `reshard_after_forward` change that saves an all-gather per step, when there is one (verified by the check in a
    second run: `launch/verify.py`). No such advice while the run has errors (`errors`): they come first. What was
    compared and what was not are `sharded_compared` and `sharded_unchecked`."""
    api = _api(run)
    job = f"This job {api.job}, not DDP: there are no DDP flags to recommend."
    if api is _REPLICATE:
        return Recommendation.unknown(
            job + " (Measured, not checked here: an evaluation forward on rank 0 alone runs fine; rank 0's "
            "torch.save of model.state_dict() holds every value, as DTensors, which load into a replicated model but "
            "not a plain one: save `{k: v.full_tensor() for k, v in sd.items()}` for that.)"
        )
    gathers = run.sharding.get("all_gathers_per_step")
    candidate = None if errors else run.reshard_candidate
    text = (
        f"{job} {_reshard_checked(gathers, candidate, errors)} (Freezing or unfreezing a parameter after "
        "fully_shard is no mistake: FSDP2 follows it, measured on 2.13 and 2.15.)"
    )

    if not (candidate and gathers):
        return Recommendation.unknown(text)
    return replace(
        Recommendation.unknown(text),
        reshard={
            "module": candidate["module"],
            "site": candidate["site"],
            "call": candidate["call"],
            "all_gathers_per_step": gathers,
            "reshard_after_forward": False,
        },
    )


def _reshard_checked(gathers: int | None, candidate: dict[str, Any] | None, errors: bool) -> str:
    """What the recommendation says of reshard_after_forward, as a sentence."""
    if errors:
        return "reshard_after_forward is looked at once the errors above are fixed."
    if candidate and gathers:
        return f"The reshard_after_forward advice above counted {gathers} all-gathers per step."
    if gathers == 0:
        return "reshard_after_forward: no all-gathers were counted (one rank holds every shard)."
    if gathers is not None:
        return (
            f"reshard_after_forward: {gathers} all-gathers per step counted; no change is advised (the last module "
            "to run forward keeps its parameters for its backward already, or its fully_shard call was not seen)."
        )
    return "reshard_after_forward was not examined (FSDP2's all-gathers could not be counted here)."


def verified_reshard(
    rec: Recommendation, gathers: int | None, same_findings: bool, error: str | None
) -> Recommendation:
    """The reshard advice after a second run applied it: verified when that run counted fewer all-gathers per step
    (one per forward and backward) and found what the first found; withdrawn otherwise (`reshard["withdrawn"]`):
    advice whose second run did not show its gain is not advice. What the second run showed goes into
    `reshard["verification"]` (`all_gathers_per_step`, `same_findings`, `error`); the report words the advice and
    the verdict (`ddp_doctor.report.data.recommendation_words`)."""
    advice = rec.reshard or {}
    before = advice.get("all_gathers_per_step")
    verified = error is None and same_findings and gathers is not None and before is not None and gathers < before
    shown = {"all_gathers_per_step": gathers, "same_findings": same_findings, "error": error}
    outcome = {"verified_all_gathers_per_step": gathers} if verified else {"withdrawn": True}
    return replace(rec, verified=verified, reshard={**advice, **outcome, "verification": shown})
