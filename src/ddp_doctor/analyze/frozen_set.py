"""Detectors of the frozen set and of DDP's own errors: `requires_grad` changed after DDP was built, nothing
trainable, and DDP's 'Expected to have finished reduction' explained. Pure functions of the `View`."""

from __future__ import annotations

import torch

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.common import all_ranks, freeze_fix, steps_of, with_flags
from ddp_doctor.analyze.passes import passes_of
from ddp_doctor.analyze.snippets import freeze_point
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, lines_of

__all__ = ["frozen_after_wrap", "no_trainable", "reduction_error", "unfrozen_after_wrap"]


def _midway(v: View, change: str) -> str:
    """How to change the frozen set mid-training, where the framework builds DDP once and keeps it."""
    if v.info.framework in ("transformers", "lightning", "accelerate"):
        # The framework owns the DDP instance, so rebuilding it (refreeze) is not open to the user; a learning
        # rate of 0 keeps the set DDP reduces fixed while the parameters do not move.
        return (
            f"to {change} mid-training, keep them trainable when DDP is built and hold their learning rate at 0 "
            "while they should not move, so the set DDP reduces never changes"
            + (
                f"; or {with_flags(v, find_unused_parameters=True)}, which copes with parameters frozen later "
                "(DDP still all-reduces them)"
                if change == "freeze"
                else ""
            )
            + "."
        )
    return (
        f"to {change} mid-training, rebuild DDP (ddp_doctor.refreeze keeps the optimizer state and checks the "
        "replicas first)."
    )


@detects(Code.FROZEN_AFTER_WRAP)
def frozen_after_wrap(v: View) -> list[Finding]:
    frozen = v.tracked & ~v.live & ~v.wrap_apart if v.steps else torch.zeros_like(v.tracked)
    inferred = not v.info.wrap_state_exact and (v.info.wrap_trainable_count or 0) > int(v.tracked.sum())
    if not frozen.any() and not inferred:
        return []
    steps = steps_of((~v.train_all[:, frozen]).any(-1)) if frozen.any() else []
    note = (
        f" DDP was built with {v.info.wrap_trainable_count} trainable tensors, but only "
        f"{int(v.tracked.sum())} required grad when observe() started."
        if inferred
        else ""
    )
    return [
        rules.frozen_after_wrap(
            params=v.params(frozen),
            ranks=all_ranks(v),
            steps=steps,
            find_unused=v.find_unused,
            static_graph=v.static_graph,
            after_first_step=bool(steps) and steps[0] > 0,
            note=note,
            fix=f"freeze {freeze_point(v.info.framework)}; " + _midway(v, "freeze"),
        )
    ]


@detects(Code.UNFROZEN_AFTER_WRAP)
def unfrozen_after_wrap(v: View) -> list[Finding]:
    if not v.steps:
        return []
    unfrozen = ~v.tracked & ~v.ignored & ~v.wrap_apart & v.train_any.any(0)
    if not unfrozen.any():
        return []
    return [
        rules.unfrozen_after_wrap(
            params=v.params(unfrozen),
            ranks=all_ranks(v),
            steps=steps_of(v.train_any[:, unfrozen].any(-1)),
            fix=f"set requires_grad=True {freeze_point(v.info.framework)}; " + _midway(v, "unfreeze"),
        )
    ]


@detects(Code.NO_TRAINABLE_PARAMETERS)
def no_trainable(v: View) -> list[Finding]:
    if not v.steps:
        return []
    empty = v.ranks("no-trainable")  # ranks with a step that trained nothing
    if not empty.count:
        return []
    return [
        Finding(
            code=Code.NO_TRAINABLE_PARAMETERS,
            severity="error",
            ranks=empty.ranks,
            more_ranks=empty.more,
            steps=steps_of(v.summary.no_trainable_steps),
            fix="set requires_grad=True on the parameters to train, before wrapping the model in DDP.",
        )
    ]


@detects(Code.REDUCTION_ERROR)
def reduction_error(v: View) -> list[Finding]:
    crashed = v.crashed(Code.REDUCTION_ERROR)
    if not crashed.count:
        return []
    missing = set(steps_of(v.summary.reduction_missing))
    step = min(v.crash_steps(Code.REDUCTION_ERROR))
    # Parameters a rank or step used, or whose module ran, are meant to train: never advise freezing them.
    meant = v.ever_used | v.summary.ran
    trained = [i for i in sorted(missing) if meant[i]]
    passes = passes_of(v)
    if passes.crashed:
        return [
            Finding(
                code=Code.REDUCTION_ERROR,
                severity="error",
                labels={"kind": "second-pass"},
                sites=lines_of(*passes.sites),
                params=v.params(sorted(missing)),
                ranks=crashed.ranks,
                more_ranks=crashed.more,
                steps=[step],
                fix=f"{with_flags(v, find_unused_parameters=True, static_graph=False)}: DDP then finds each pass's "
                "own set of parameters. static_graph=True fails on this pattern too ('Your training graph has "
                "changed').",
            )
        ]
    left = [i for i in sorted(missing) if v.orphaned[i]]
    if left and len(left) == len(missing):
        # A module replaced after DDP was built: its old parameters stay in the reducer and get no gradient. The
        # names now hold the new module's parameters, which the script trains: freezing them is no fix.
        return [
            Finding(
                code=Code.REDUCTION_ERROR,
                severity="error",
                labels={"kind": "replaced"},
                params=v.params(left),
                ranks=crashed.ranks,
                more_ranks=crashed.more,
                steps=[step],
                fix="build DDP after the module is replaced (see unregistered-parameters); freezing these names would "
                "not help: they now hold the new module's parameters, which the script trains.",
            )
        ]
    if trained:
        fix = (
            f"do not freeze them: {', '.join(v.info.param_names[i] for i in trained[:4])}"
            f"{' ...' if len(trained) > 4 else ''} got a gradient on some rank or step, or their module ran. "
            f"{with_flags(v, static_graph=True)} if each rank's used set is the same every step, else "
            f"{with_flags(v, find_unused_parameters=True)}; see the recommendation"
        )
    else:
        fix = freeze_fix(v) + "; see the recommendation for the cheapest flags"
    return [
        Finding(
            code=Code.REDUCTION_ERROR,
            severity="error",
            params=v.params(sorted(missing)),
            ranks=crashed.ranks,
            more_ranks=crashed.more,
            steps=[step],
            fix=fix + ".",
        )
    ]
