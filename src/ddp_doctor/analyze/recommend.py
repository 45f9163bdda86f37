"""The recommendation: the cheapest DDP configuration that is correct for the observed used-set.

Preference order, cheapest first:
  (a) parameters never used on any rank or step are frozen before wrapping: no hook, no communication at all;
  (b) find_unused_parameters=False when every remaining trainable parameter is used on every rank and step;
  (c) static_graph=True when each rank's used-set is the same on every step (also covers reentrant checkpointing);
  (d) find_unused_parameters=True only when the used-set changes between steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddp_doctor.analyze.hidden_use import hidden_params
from ddp_doctor.analyze.passes import passes_of
from ddp_doctor.analyze.view import View
from ddp_doctor.core.codes import Code, Family, info
from ddp_doctor.core.findings import Diagnosis, Finding, Recommendation

__all__ = ["recommend", "recommend_after_failure", "verified_by_second_run"]


def _rec(v: View, *, find_unused: bool, static: bool, freeze: list[str], reason: str, verified: bool) -> Recommendation:
    rec = Recommendation(
        find_unused_parameters=find_unused,
        static_graph=static,
        gradient_as_bucket_view=bool(v.info.ddp_config.get("gradient_as_bucket_view", False)),
        freeze_before_wrap=freeze,
        reason=reason,
        verified=verified,
    )
    return rec


def recommend(v: View, findings: list[Finding]) -> Recommendation:
    """Pick flags from what was observed, never from what the script currently uses."""
    if v.wrap_apart.any():
        return Recommendation.unknown(
            "No DDP flags can be recommended: the ranks handed DDP different trainable parameters when it was built "
            "(param-shapes-differ above), so what DDP reduces differs by rank whatever its flags. Freeze the same "
            "parameters on every rank before wrapping, then check again."
        )
    passes = passes_of(v)
    if (passes.steps and not passes.inner) or passes.crashed_twice:
        return Recommendation.unknown(
            f"No DDP flags can be recommended: backward passes through one forward{passes.where()} reach "
            "different parameters, and DDP reduces once per forward whatever its flags (find_unused_parameters=True "
            "and static_graph=True fail on this pattern too). Give each backward pass its own forward through the "
            "DDP model, then check again: find_unused_parameters=True is the flag for passes whose sets differ."
        )

    if not v.steps:
        if passes.crashed:
            return _rec(
                v,
                find_unused=True,
                static=False,
                freeze=[],
                verified=False,
                reason="find_unused_parameters=True: DDP failed at a second backward pass through one forward"
                f"{passes.where()}, which the framework prepares on its own (Lightning's manual_backward); the first "
                "pass left parameters without a gradient that a later pass trains. With this flag DDP finds each "
                "pass's own set; static_graph=True fails on this pattern too. Not verified yet: run the check again "
                "with it (--ddp-kwargs '{\"find_unused_parameters\": true}').",
            )
        if v.crashed("mark-ready-twice").count:
            return _rec(
                v,
                find_unused=False,
                static=True,
                freeze=[],
                verified=False,
                reason="The first step crashed because parameters outside the graph of DDP's forward "
                "outputs (used after forward, or under reentrant checkpointing) got gradients with "
                "find_unused_parameters=True; static_graph=True handles that. Re-run the check with "
                "it to see the full used set.",
            )
        return Recommendation.unknown(
            "No complete step was observed, so nothing supports any flags: the script's own stay as they are."
        )

    if v.crashed_before_first_step:
        return _rec(
            v,
            find_unused=True,
            static=False,
            freeze=[],
            verified=False,
            reason="find_unused_parameters=True: DDP failed at a forward before any optimizer step, because the "
            "backward of an earlier forward gave no gradient to some parameters. A later forward of the same "
            "optimizer step may train them (a GAN's generator, after the discriminator's pass); this flag handles "
            "that, and parameters that are never used, alike. static_graph=True needs the same parameters in every "
            "forward's backward, which the steps seen before the failure cannot show.",
        )

    names = v.info.param_names
    intended = v.summary.rank0_trainable & ~v.ignored  # what the script trains now (rank 0, last step)
    ever = v.ever_used
    _, dynamic, _, _ = v.usage()
    frozen_after = v.tracked & ~v.live
    # Frozen after wrap before any observed step trained them: the script meant them frozen from the start.
    # Frozen after training for some steps (gradual freezing): the set DDP must reduce changes over time.
    frozen_later = frozen_after & v.train_any.any(0)
    # Only parameters whose modules never ran may be frozen (../shared/DESIGN.md, 2.3): a module that ran but got no gradient is
    # blocked (no_grad, detach, a reentrant checkpoint), and the script means to train it.
    _, blocked = v.unused_by_cause()
    # What a module replaced after wrap left in the reducer is never frozen by name: the name now holds the new,
    # trained module's parameter (`unregistered-parameters` says how to fix that).
    freeze_mask = ((intended & ~ever & ~blocked) | (frozen_after & ~frozen_later)) & ~v.orphaned
    freeze = [names[i] for i in freeze_mask.nonzero().flatten().tolist()]
    # Left behind by a module replaced after wrap: still in DDP's reducer, never used, and not to be frozen by name.
    left = intended & ~ever & v.orphaned
    rest = intended & (ever | blocked | left)
    all_used = bool(v.used_all[:, rest].all()) and not dynamic.any()
    stable = not bool(v.summary.varies[rest].any()) and not dynamic.any()  # each rank's set is the same every step
    outside_h, reentrant_h = hidden_params(v)
    outside, reentrant = bool(outside_h.ranks), bool(reentrant_h.ranks)

    parts = []
    if blocked.any():
        parts.append(
            f"{int(blocked.sum())} parameter(s) ran in forward but got no gradient (grad-blocked): fix that "
            "first; until then they count as unused, and they are not frozen here because the script means "
            "to train them."
        )
    if freeze:
        parts.append(
            f"{len(freeze)} parameter(s) never reached the loss on any rank in {v.steps} steps"
            + (" or were frozen after wrap" if (frozen_after & ~frozen_later).any() else "")
            + ": freezing them before wrapping removes them from DDP entirely (if some are meant to "
            "train later, use static_graph=True instead)."
        )
    if left.any():
        parts.append(
            f"{int(left.sum())} parameter(s) that a module replaced after DDP was built left in DDP's reducer get no "
            "gradient (unregistered-parameters): flags can only tolerate them; building DDP after the replacement "
            "removes them and syncs the new ones."
        )
    if frozen_later.any():
        find_unused, static = True, False
        parts.append(
            f"{int(frozen_later.sum())} parameter(s) trained for some steps and were then frozen after "
            "DDP was built: find_unused_parameters=True is the only flag that copes with a frozen set that "
            "changes, though DDP still all-reduces them. "
            + (
                "Rebuilding DDP at each change (ddp_doctor.refreeze) stops that communication."
                if v.info.framework == "torch"
                else f"{v.info.framework} owns the DDP model, so instead of freezing, a learning rate of 0 keeps "
                "the set DDP reduces fixed."
            )
        )
    elif passes.steps:
        find_unused, static = True, False
        parts.append(
            f"find_unused_parameters=True: the backward passes through one forward{passes.where()} reach different "
            "parameters. Lightning prepares DDP's reduction at each of them (manual_backward), and this flag lets "
            "DDP find each pass's own set; the default flags and static_graph=True fail on this pattern."
        )
    elif all_used and not reentrant:
        find_unused, static = False, False
        parts.append(
            f"Every {'other ' if freeze else ''}trainable parameter got a gradient on all {v.world} ranks in all {v.steps} "
            "steps, so find_unused_parameters=False is correct and cheapest."
        )
    elif stable:
        find_unused, static = False, True
        why = (
            "reentrant checkpointing hides parameters from DDP's forward graph"
            if reentrant
            else "each rank used the same parameters on every step"
        )
        parts.append(
            f"static_graph=True: {why}, so DDP can learn the used set once instead of searching the graph every step."
        )
    else:
        find_unused, static = True, False
        parts.append(
            "find_unused_parameters=True: the set of used parameters changes between steps, and only it handles that."
        )
        if outside:
            parts.append(
                "But parameters are also used outside forward, which find_unused_parameters=True "
                "cannot handle: move that computation into forward."
            )
    if v.steps < 2:
        parts.append(f"Based on {v.steps} observed step; observe more steps to confirm the used set is stable.")

    errors = [f for f in findings if f.severity == "error"]
    same = find_unused == v.find_unused and static == v.static_graph and not freeze
    verified = same and not errors and v.steps >= 2
    if verified:
        # gradients that differ by design (post-local SGD, at info) agreed only before they began to
        apart = min((s for f in findings if f.code == Code.GRADS_NOT_SYNCED for s in f.steps), default=None)
        parts.append(
            "Verified: this run already uses it, and every trainable gradient agreed across the ranks at each "
            + ("observed optimizer step." if apart is None else f"observed optimizer step before step {apart}.")
        )
    elif errors and same:
        parts.append("The flags are right, but errors remain that flags cannot fix (see the findings).")
    return _rec(v, find_unused=find_unused, static=static, freeze=freeze, reason=" ".join(parts), verified=verified)


_FLAGS_FOR_FAILURE = {
    # DDP's own error on the ranks, as explained: the flags it calls for, and why.
    Code.USED_OUTSIDE_FORWARD: (
        False,
        True,
        "static_graph=True, find_unused_parameters=False: parameters used outside DDP's forward got gradients with "
        "find_unused_parameters=True ('Expected to mark a variable ready only once'); static_graph=True handles "
        "them.",
    ),
    Code.REENTRANT_CHECKPOINT: (
        False,
        True,
        "static_graph=True, find_unused_parameters=False: parameters under reentrant activation checkpointing got "
        "gradients with find_unused_parameters=True ('Expected to mark a variable ready only once'); "
        "static_graph=True handles them (use_reentrant=False is the code fix).",
    ),
    Code.STATIC_GRAPH_UNSAFE: (
        True,
        False,
        "find_unused_parameters=True, static_graph=False: the set of parameters that reach the loss changed "
        "between steps under static_graph=True ('Your training graph has changed'), and only "
        "find_unused_parameters=True handles a set that changes.",
    ),
}


def recommend_after_failure(findings: list[Finding], ddp_config: dict[str, Any], *, where: str) -> Recommendation:
    """The recommendation for a run whose ranks failed before they could exchange records.

    Flags are supported by DDP's own error when it names its cause: parameters used outside forward (or under
    reentrant checkpointing) with find_unused_parameters=True call for static_graph=True; a used set that changed
    under static_graph=True calls for find_unused_parameters=True. A `rank-dependent-graph` finding (a rank's
    reduction error naming parameters another rank trained) supports find_unused_parameters=True: the used set
    depends on the rank, and DDP failed before a second step showed whether each rank's set stays the same; it
    works either way and keeps those parameters trained on the ranks that use them (static_graph=True is cheaper
    but wrong if a set changes, so it waits for a run that sees every step). Anything else supports no flags: the
    flags are None and the reason says what is known (never the script's own flags, which may be the failing
    ones). `check` then verifies flags it recommends in a second run (`launch/verify.py`).

    Args:
        findings: the failure's findings (`failure_findings`).
        ddp_config: the flags the script built DDP with.
        where: where each rank was when the run ended (for the text).
    """
    bucket_view = bool(ddp_config.get("gradient_as_bucket_view", False))
    shown = any(f.severity in ("error", "warning") for f in findings)
    explained = [f for f in findings if f.code in _FLAGS_FOR_FAILURE and f.severity == "error"]
    calls_for = {_FLAGS_FOR_FAILURE[f.code][:2] for f in explained}
    if len(calls_for) == 1:
        find_unused, static = calls_for.pop()
        script = (bool(ddp_config.get("find_unused_parameters")), bool(ddp_config.get("static_graph")))
        if (find_unused, static) != script:
            return Recommendation(
                find_unused_parameters=find_unused,
                static_graph=static,
                gradient_as_bucket_view=bucket_view,
                freeze_before_wrap=[],
                verified=False,
                reason=_FLAGS_FOR_FAILURE[explained[0].code][2],
            )
    by_rank = next((f for f in findings if f.code == Code.RANK_DEPENDENT_GRAPH and f.params), None)
    if by_rank is not None and not ddp_config.get("find_unused_parameters") and not ddp_config.get("static_graph"):
        names = ", ".join(p.name for p in by_rank.params[:6]) + (", ..." if len(by_rank.params) > 6 else "")
        flags = '{"find_unused_parameters": true}'
        return Recommendation(
            find_unused_parameters=True,
            static_graph=False,
            gradient_as_bucket_view=bucket_view,
            freeze_before_wrap=[],
            verified=False,
            reason=f"find_unused_parameters=True: the parameters that reach the loss depend on the rank ({names}), "
            "and DDP failed before a second step could show whether each rank's set stays the same. This flag works "
            f"either way and keeps them trained on the ranks that use them. A run with it (--ddp-kwargs '{flags}') "
            "sees every step and says whether static_graph=True, which is cheaper, is safe.",
        )
    return Recommendation.unknown(
        "No DDP flags can be recommended: the ranks could not finish the observed steps together, so the used "
        "set is not known on every rank. Fix the failure above and run the check again."
        if shown
        # Never point at a failure the report does not show.
        else "No DDP flags can be recommended: the ranks could not compare what they observed, so the used set "
        f"is not known on every rank. Where they were: {where}. Run the check again; if this repeats, please "
        "report it."
    )


def verified_by_second_run(
    rec: Recommendation, *, applied: str, needed: int, second: Diagnosis | None, error: str | None = None
) -> Recommendation:
    """`rec` after a second run with its flags applied (`launch/verify.py`): verified when that run saw `needed`
    steps on every rank with no error and no crash; refuted (no flags known) when the flags themselves failed there
    (a crash, DDP's error again, a used set they do not cope with); what the second run showed goes into
    `verification` either way, and the report words it.

    Args:
        rec: the first run's recommendation.
        applied: the flags the second run used, as `--ddp-kwargs` JSON.
        needed: the steps the second run must observe.
        second: the second run's diagnosis; None when it produced no report.
        error: why the second run produced no report.
    """
    errors = [f for f in second.findings if f.severity == "error"] if second is not None else []
    shown: dict[str, Any] = {
        "ddp_kwargs": applied,
        "steps_needed": needed,
        "steps_observed": second.steps_observed if second is not None else 0,
        "errors": [f.code for f in errors],
        "crashed": bool(second is not None and second.crashes),
        "error": error if second is None else None,
    }
    if second is None:
        return dataclasses.replace(rec, verification={**shown, "outcome": "not-run"})
    if not errors and not second.crashes and second.steps_observed >= needed:
        return dataclasses.replace(rec, verified=True, verification={**shown, "outcome": "verified"})
    flag_errors = [f for f in errors if info(f.code).family in (Family.GRAPH, Family.CRASH)]
    if second.crashes or flag_errors:
        # The flags themselves failed: advice proven wrong is not advice. What was tried stays in the reason; the
        # flags become unknown (null in the JSON).
        first = [f.code for f in flag_errors] + [c for c in shown["errors"] if c not in {f.code for f in flag_errors}]
        refuted = Recommendation.unknown(rec.reason)
        return dataclasses.replace(refuted, verification={**shown, "errors": first, "outcome": "refuted"})
    return dataclasses.replace(rec, verification={**shown, "outcome": "unconfirmed"})
