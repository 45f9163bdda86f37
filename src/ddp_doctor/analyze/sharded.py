"""The findings only a job that shards with FSDP2 (`fully_shard`, or the FSDP2-based `replicate`) can have, beside
the codes it shares with DDP (each decided, for both, in the module its row in core/codes.py names):
`gradient-sync-off`, `low-precision-reduce`, `low-precision-weights`; and what the check recommends instead of DDP's
flags. Pure: the agreed facts (`ShardedRun`) in, findings out; each detector registered with ``road="sharded"``
(`analyze/view.py`'s `detects`).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_train.py`, 12 steps): each of
the three mistakes runs to the end with exit code 0 and prints nothing. The optimizer built before `fully_shard`,
and gradient sync never switched back on, change no weight at all; a root left unsharded trains its head apart on
each rank (its weight sums end at -2.187 and -2.443). Rank 0 alone calling `torch.save(model.state_dict(), path)`
also ends with exit code 0: the file holds DTensors with rank 0's shard (a [32, 16] local tensor of a [64, 16]
weight), and loading it into the unsharded model raises *aten.copy_.default got mixed torch.Tensor and DTensor*.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ddp_doctor.analyze.parallelism import REPLICATE, api_of, every_rank, observed_steps, unchanged
from ddp_doctor.analyze.sharded_fixes import sync_fix
from ddp_doctor.analyze.view import detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, Recommendation, lines_of
from ddp_doctor.core.sharded_run import ShardedRun

__all__ = [
    "gradient_sync_off",
    "low_precision_reduce",
    "low_precision_weights",
    "sharded_recommendation",
    "verified_reshard",
]

_LOW = ("bfloat16", "float16")


@detects(Code.GRADIENT_SYNC_OFF, road="sharded")
def gradient_sync_off(run: ShardedRun) -> list[Finding]:
    """Gradient sync switched off (`set_requires_gradient_sync(False)`, or HSDP's `set_requires_all_reduce(False)`)
    at every observed optimizer step."""
    if not run.sync_off_steps or run.sync_off_steps < run.steps:
        return []
    api = api_of(run)
    site = f" (last switched off at {run.sync_off_site})" if run.sync_off_site else ""
    what = (  # set_requires_all_reduce: HSDP's switch for the replicas
        f"{api.name} then reduce-scatters the gradients within each replica and keeps them aside for the "
        "all-reduce across the replicas that never comes"
        if run.sync_off_call == "set_requires_all_reduce"
        else f"{api.name} then {api.reduces} no gradient"
    )
    return [
        Finding(
            code=Code.GRADIENT_SYNC_OFF,
            severity="error",
            title=f"gradient sync was off at all {run.steps} optimizer steps",
            detail=f"{run.sync_off_call}(False){site} was in force every time the optimizer stepped, and it was "
            f"never switched back on: {what}, the {api.done} parameters get no gradient, and the optimizer skips "
            "them. " + unchanged(run),
            ranks=every_rank(run),
            steps=observed_steps(run),
            sites=lines_of(run.sync_off_site or ""),
            fix=sync_fix(run.framework, run.sync_off_call),
        )
    ]


@detects(Code.LOW_PRECISION_REDUCE, road="sharded")
def low_precision_reduce(run: ShardedRun) -> list[Finding]:
    """FSDP2 reduce-scattered the gradients in a low dtype while the weights it steps are float32."""
    if not run.low_reduce or not run.model_params_stepped:
        return []
    low, weights = run.low_reduce
    policy = {f"policy_{k}": "/".join(run.sharding.get(k) or []) or "unset" for k in ("param_dtype", "reduce_dtype")}
    finding = Finding(
        code=Code.LOW_PRECISION_REDUCE,
        severity="info",
        ranks=every_rank(run),
        labels={"reduce_dtype": low, "weights_dtype": weights, **policy},
        measured=[
            Measure("mean_relative_difference", run.low_reduce_rel, "fraction"),
            Measure("largest_difference", run.low_reduce_abs, "abs"),
        ],
        fix="reduce in float32 and keep computing in the low dtype: `MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32)` in every fully_shard call (the reduce-scatter then moves twice the bytes). "
        'With Accelerate (whose mixed_precision="bf16" sets both to bfloat16): '
        "`FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=MixedPrecisionPolicy("
        "param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`.",
    )
    return [finding]


@detects(Code.LOW_PRECISION_WEIGHTS, road="sharded")
def low_precision_weights(run: ShardedRun) -> list[Finding]:
    """A policy whose param_dtype is the low dtype the sharded weights already have: the model was cast before
    `fully_shard`, so the optimizer steps low-precision weights (FSDP2 keeps a sharded parameter in its own dtype).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps at lr 1e-4
    (`tests/scripts/fsdp2_mixed.py`): with the policy on a float32 model (`--policy bf16`) every weight of the first
    layer changed; with the model cast to bfloat16 first (`--policy bf16-weights`) 89.3% of them never changed (the
    updates were below bfloat16's resolution). Both exit 0.
    """
    policy = run.sharding.get("param_dtype") or []
    if not policy or not run.weights_dtype or not set(run.weights_dtype) <= set(policy) & set(_LOW):
        return []
    dtype = "/".join(run.weights_dtype)
    finding = Finding(
        code=Code.LOW_PRECISION_WEIGHTS,
        severity="warning",
        ranks=every_rank(run),
        steps=observed_steps(run),
        labels={"weights_dtype": dtype, "param_dtype": "/".join(policy)},
        fix=f"keep the model in float32 until fully_shard (drop the cast to {dtype} before it): the policy's "
        f"param_dtype={dtype} still computes in {dtype}, and the optimizer steps float32 weights. If training in "
        f"pure {dtype} is meant, use an optimizer made for it (stochastic rounding or Kahan summation).",
    )
    return [finding]


def sharded_recommendation(run: ShardedRun, *, errors: bool = False) -> Recommendation:
    """No DDP flags for a sharded model: what the check can say about the sharding instead, and the one
    `reshard_after_forward` change that saves an all-gather per step, when there is one (verified by the check in a
    second run: `launch/verify.py`). No such advice while the run has errors (`errors`): they come first. What was
    compared and what was not are `sharded_compared` and `sharded_unchecked`."""
    api = api_of(run)
    job = f"This job {api.job}, not DDP: there are no DDP flags to recommend."
    if api is REPLICATE:
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
