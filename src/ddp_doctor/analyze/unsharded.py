"""`unsharded-params-not-synced`: trainable parameters of a sharded model that belong to no `fully_shard` (or
`replicate`) group, so FSDP2 never reduces their gradients. Pure: the agreed facts (`ShardedRun`) in.

Why they are outside decides the fix: the root left unsharded, a module added after sharding, or the script's own
`ignored_params`, which FSDP2 leaves to the script to synchronise. Whether they are a mistake is measured, not
assumed: weights that differ across ranks are an error; weights that trained and stayed equal on every rank are
kept in sync by something (the script's own all-reduce, or the same batches on every rank): an info; weights that
did not change at all tell nothing yet: a warning.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 steps, each rank its own batches
(`tests/scripts/fsdp2_ignored.py`, the head passed as `ignored_params`): with nothing syncing it the head's weight
sums end at 0.071712 and 0.250339; with the script averaging its gradients (all_reduce, then divide) before each
step they are equal, 0.115566 on both ranks. Both end with exit code 0.
"""

from __future__ import annotations

from ddp_doctor.analyze.parallelism import Api, api_of, every_rank
from ddp_doctor.analyze.sharded_fixes import root_fix
from ddp_doctor.analyze.view import detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure
from ddp_doctor.core.sharded_run import ShardedRun

__all__ = ["unsharded_finding", "unsharded_params"]


def _cause(run: ShardedRun) -> str:
    """Why the parameters are outside every group: `beside` (tensors the optimizer steps that the model never held),
    `ignored` (the script's ignored_params), `added` (a module added after the root was sharded), `root` (the root
    not sharded)."""
    if run.outside_model and all(run.outside_model):
        return "beside"
    if run.ignored and all(run.ignored):
        return "ignored"
    return "added" if run.sharding.get("root_sharded") else "root"


def _why(run: ShardedRun, api: Api) -> str:
    return {
        "beside": "the optimizer steps them beside the model, which does not hold them",
        "ignored": f"the script passed them to {api.call} as ignored_params at {run.ignored_site or 'its call'}",
        "added": f"a module added after {api.after}",
        "root": f"the root module was not {api.done}",
    }[_cause(run)]


def _fix(run: ShardedRun, api: Api) -> str:
    call = api.call
    return {
        "beside": f"register them on the model before {call} (used inside its forward), so that a {call} group "
        "holds them; or average their gradients on every rank before each optimizer step (`dist.all_reduce(t.grad); "
        "t.grad /= dist.get_world_size()`).",
        "ignored": f"{call} leaves ignored_params to the script: average their gradients on every rank before each "
        "optimizer step (`for p in params: dist.all_reduce(p.grad); p.grad /= dist.get_world_size()`), or leave "
        f"them out of ignored_params so that the {call} group holds them.",
        "added": f"build every module before the {call} calls (the root's {call} groups every parameter not in an "
        f"inner group), or {call} the added module too.",
        "root": root_fix(run.framework, call),
    }[_cause(run)]


@detects(Code.UNSHARDED_PARAMS_NOT_SYNCED, road="sharded")
def unsharded_params(run: ShardedRun) -> list[Finding]:
    """The trainable parameters outside every group, when there are any."""
    if not run.unsharded:
        return []
    found = unsharded_finding(run, every_rank(run), api_of(run))
    return [found] if found is not None else []


def unsharded_finding(run: ShardedRun, ranks: list[int], api: Api) -> Finding | None:
    """The finding for `run.unsharded` (not empty): error, info or warning, as the docstring above says. Tensors
    the optimizer steps beside the model are named only when they differ across ranks (ground truth:
    tests/sync/test_check_fsdp2_state.py)."""
    steps = list(range(run.steps))
    differ = [p for p, d in zip(run.unsharded, run.unsharded_differ) if d]
    beside = run.outside_model or [False] * len(run.unsharded)
    kept = [p for p, b in zip(run.unsharded, beside) if not b]  # beside the model and equal: compared, not named
    if not differ and not kept:
        return None
    why = _why(run, api)
    # What every severity carries: the ranks and steps compared, why they are outside (and the ignored_params line).
    evidence = {
        "ranks": ranks,
        "steps": steps,
        "labels": {"kind": _cause(run)},
        "sites": [run.ignored_site] if _cause(run) == "ignored" and run.ignored_site else [],
    }
    observed = Measure("steps_observed", run.steps, "count")
    if differ:
        return Finding(
            code=Code.UNSHARDED_PARAMS_NOT_SYNCED,
            severity="error",
            title=f"{len(differ)} "
            + (
                f"tensor(s) the optimizer steps beside the model ({', '.join(p.name for p in differ[:4])})"
                if _cause(run) == "beside"
                else f"parameters outside every {api.call} group"
            )
            + " differ across ranks",
            detail=f"These trainable parameters belong to no {api.call} group ({why}), so they stay plain tensors "
            "and nothing reduces their gradients: each rank trains its own copy on its own batches. After "
            f"{run.steps} steps they differ (the largest difference of a weight's sum between ranks is "
            f"{run.unsharded_gap:.3g})"
            + ("." if _cause(run) == "beside" else "; whatever rank 0 saves is one rank's copy."),
            params=differ,
            measured=[Measure("largest_sum_gap", run.unsharded_gap, "abs"), observed],
            fix=_fix(run, api),
            **evidence,
        )
    if run.unsharded_changed and run.steps >= 2:
        return Finding(
            code=Code.UNSHARDED_PARAMS_NOT_SYNCED,
            severity="info",
            title=f"{len(kept)} parameters outside every {api.call} group trained and stayed equal across ranks",
            detail=f"These trainable parameters belong to no {api.call} group ({why}), so {api.call} does not "
            f"reduce their gradients. Over {run.steps} steps they changed and are still the same on every rank: "
            "something keeps them in sync, the script's own all-reduce of their gradients, or the same batches on "
            "every rank.",
            params=kept,
            measured=[observed],
            fix="nothing, if the script averages their gradients itself; if every rank trains on the same batches "
            f"instead, that stops holding with a distributed sampler: then {_fix(run, api)}",
            **evidence,
        )
    return Finding(
        code=Code.UNSHARDED_PARAMS_NOT_SYNCED,
        severity="warning",
        title=f"{len(kept)} parameters outside every {api.call} group have nothing syncing them",
        detail=f"These trainable parameters belong to no {api.call} group ({why}), so {api.call} does not reduce "
        f"their gradients. After {run.steps} steps they are still the same on every rank, and did not change "
        "(they got no gradient, or only one step was observed); they drift apart once they train on different "
        "batches, unless the script averages their gradients itself.",
        params=kept,
        measured=[observed],
        fix=_fix(run, api),
        **evidence,
    )
