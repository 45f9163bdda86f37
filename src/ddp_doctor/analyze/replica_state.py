"""Replicas that hold different weights (`replica-divergence`), decided here for every parallelism: DDP's per-step
digests or the replicas of a model FSDP2 replicates (one rule, on the `Agreed` facts), modules the script runs
beside the DDP model, the modules' train/eval modes. Their buffers are `analyze/buffer_state.py`'s. Pure."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.common import with_evidence, with_more
from ddp_doctor.analyze.links import DIVERGENCE_CAUSES, UNSYNCED, cause_fix, divergence_fix, ruled_out
from ddp_doctor.analyze.local_sgd import weights_words
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.tree_digest import differing, same_fingerprint, step_apart
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed, WeightsApart
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef, lines_of

__all__ = ["modes_apart", "modes_differ", "modules_beside_apart", "replica_divergence", "replicas_parted"]


@detects(Code.REPLICA_DIVERGENCE, reads_found=True, road="every")
def replica_divergence(a: Agreed, found: frozenset[str]) -> list[Finding]:
    """The replicas' weights apart, for every parallelism: what the other findings say caused it decides the fix
    (`links.DIVERGENCE_CAUSES`); post-local SGD's replicas part by design. Ground truth:
    tests/sync/test_check_replicas.py, and for a cause the check names: `tests/scripts/replicate_train.py
    --mistake lr-rank0` (rank 0's AdamW at twice the others' learning rate, every rank seeded alike) under plain
    torchrun: exit 0, nothing said, head.weight sums -1.833269 on rank 0 and -1.268686 on rank 1 after 12 steps.
    The check said `optimizer-differs` and, under it, that the replicas had started apart (replicate does not
    broadcast the initial weights) and to seed alike: they had been seeded alike."""
    w = a.weights_apart
    if w is None or a.world < 2:
        return []
    ranks = sorted({w.reference, *w.ranks})
    local = a.local_averaging
    if local is not None and local.explains(w.steps) and not found.intersection(UNSYNCED):
        severity, title, detail, fix = weights_words(local)
        return [
            Finding(
                code=Code.REPLICA_DIVERGENCE,
                severity=severity,
                title=title,
                detail=detail,
                fix=fix,
                params=w.params,
                ranks=ranks,
                steps=w.steps,
                more_ranks=w.more,
                sites=lines_of(local.averager_site or ""),
                measured=[Measure("largest_sum_difference", w.gap or 0.0, "abs"), *local.measured],
            )
        ]
    if a.parallelism != "ddp":
        causes = [c for c in DIVERGENCE_CAUSES if c in found]
        return [replicas_parted(w, parallelism=a.parallelism, causes=causes)]
    when = "already when observe() started" if w.at_start else f"after step {w.steps[0]}"
    return [
        with_more(
            with_evidence(
                rules.replica_divergence(
                    title=f"weights of {_count(len(w.params), 'parameter')} differ across ranks",
                    detail=f"The replicas are no longer identical, {when}; the largest difference of a parameter's sum "
                    f"between rank 0 and another rank is {w.gap:.3g}. Whatever rank 0 saves is not what the other ranks "
                    "trained.",
                    params=w.params,
                    ranks=ranks,
                    steps=w.steps,
                    fix=divergence_fix(found, a.grads_measured),
                ),
                measured=[Measure("largest_sum_difference", w.gap, "abs")],
                ruled_out=ruled_out(found),
                labels={"apart_since": "start" if w.at_start else "step"},
            ),
            w.more,
        )
    ]


@detects(Code.REPLICA_DIVERGENCE)
def modules_beside_apart(v: View) -> list[Finding]:
    """Modules the script calls outside DDP's forward (a distillation teacher, a frozen encoder) whose parameters or
    buffers differ across ranks: DDP broadcasts only the model it wraps, so each rank computes its loss with its own
    copy. Ground truth: tests/sync/test_check_beside_modules.py."""
    odd, _ = differing(v)
    mine = v.meta(0).get("beside_modules") or []
    if not odd or not mine:
        return []
    theirs = [{e["name"]: e["fp"] for e in v.meta(r).get("beside_modules") or []} for r in odd]
    # A module some ranks never called (an EMA evaluated on rank 0 alone) is not compared.
    apart = [e for e in mine if any(e["name"] in t and not same_fingerprint(t[e["name"]], e["fp"]) for t in theirs)]
    if not apart:
        return []
    names = ", ".join(e["name"] for e in apart)
    called = "; ".join(f"{e['name']} at {e['site']}" for e in apart if e.get("site"))
    return [
        Finding(
            code=Code.REPLICA_DIVERGENCE,
            severity="error",
            title=f"{names}, run beside the DDP model, holds different weights on different ranks",
            detail=f"The script calls {names} outside DDP's forward{f' ({called})' if called else ''}. DDP broadcasts "
            "rank 0's weights of the model it wraps only, so nothing made this module's equal: its parameters or "
            "buffers differ across ranks (built from each rank's own seed, or loaded on some ranks only), and each "
            "rank computes its loss with a different function.",
            params=[ParamRef(e["name"], e["numel"]) for e in apart],
            ranks=[0, *odd],
            steps=[step_apart(v, "beside_modules")[0]],
            fix="build it alike on every rank (the same seed before creating it, or the same checkpoint loaded on "
            "every rank), or copy rank 0's once before training: `for t in [*module.parameters(), "
            "*module.buffers()]: dist.broadcast(t.data, src=0)`.",
            sites=lines_of(*(e.get("site") or "" for e in apart)),
            measured=[Measure("modules_apart", len(apart), "count")],
        )
    ]


_MODES_APART = {
    "ddp": "so their gradients and buffers part although DDP syncs every gradient.",
    "replicate": "so their gradients and buffers part although replicate syncs every gradient.",
    "fsdp2": "so the gradients FSDP2 averages come from different computations, and buffers such as BatchNorm's "
    "running statistics part.",
}


def modes_apart(
    *, step: int, held: dict[int, dict[str, Any]], reference: int, ranks: list[int], parallelism: str
) -> Finding:
    """`replica-divergence` (a warning) from train/eval modes at `step`, for every parallelism: `held` maps ranks
    to their modes entry (`training`, `other_mode`, `other_mode_count`), `reference` first."""
    said = []
    for r, entry in list(held.items())[:4]:
        mode = "train" if entry.get("training") else "eval"
        other = entry.get("other_mode") or []
        more = entry.get("other_mode_count", 0) - len(other)
        except_ = (
            f" except {', '.join(other)}{f' (+{more} more)' if more > 0 else ''} "
            f"({'eval' if mode == 'train' else 'train'})"
            if other
            else ""
        )
        said.append(f"rank {r}: the model in {mode} mode{except_}")
    return Finding(
        code=Code.REPLICA_DIVERGENCE,
        severity="warning",
        title=f"modules are in train mode on some ranks and in eval mode on others at step {step}",
        detail=f"When optimizer step {step} ended, the ranks' models were not in the same mode ({'; '.join(said)}"
        f"). Dropout, BatchNorm and any code that reads `self.training` then compute differently on the ranks, "
        f"{_MODES_APART[parallelism]} Rank {reference}'s model was in "
        f"{'train' if held.get(reference, {}).get('training') else 'eval'} mode.",
        params=[],
        ranks=ranks,
        steps=[step],
        fix="set the mode on every rank alike: after an evaluation that calls `model.eval()` on some ranks, call "
        "`model.train()` on the same ranks before training resumes (or evaluate on every rank).",
    )


@detects(Code.REPLICA_DIVERGENCE, road="every")
def modes_differ(a: Agreed) -> list[Finding]:
    """Modules in train mode on some ranks and in eval mode on others when a step closed, whatever the
    parallelism: dropout, BatchNorm and any `self.training` branch compute differently there (`modes_apart`).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py
    --mistake train-rank0`: a Dropout in the first block; an evaluation in eval mode on every rank after the third
    step, then `model.train()` on rank 0 alone): exit 0, nothing said; rank 1 trains on in eval mode (dropout off),
    head.weight sums to -1.407930 (-1.468885 with every rank back in train mode)."""
    if (m := a.modes_apart) is None:
        return []
    found = modes_apart(step=m.step, held=m.held, reference=m.reference, ranks=m.named, parallelism=a.parallelism)
    return [with_more(found, m.more)]


def replicas_parted(w: WeightsApart, *, parallelism: str, causes: list[str]) -> Finding:
    """`replica-divergence` of a model whose parameters FSDP2 replicates (`replicate`, HSDP's replicate dimension):
    the local tensors of `w.params` differ across the ranks that hold the same one, already after the first
    observed step, or first after `w.first_step`. `causes`: the codes of the report's findings that explain it
    (their fix is this one's). Without one: neither `replicate` nor `fully_shard` broadcasts rank 0's weights when
    it wraps the model, as DDP does, so copies apart at the first comparison most likely started apart; copies
    that agreed then were changed outside the synced update."""
    params, at_first, first_step, steps, hsdp_row = w.params, w.at_start, w.first_step, w.observed, w.row
    call = "replicate" if parallelism == "replicate" else "fully_shard"
    holders = (
        "every rank holds the whole of each parameter"
        if hsdp_row is None
        else (f"the ranks along the mesh's replicate dimension hold the same shard (here shard {hsdp_row})")
    )
    names = ", ".join(p.name for p in params[:4]) + (f" and {len(params) - 4} more" if len(params) > 4 else "")
    if at_first:
        when = "already when the first observed optimizer step ended"
        cause = (
            f"they are not compared before it, and most likely started apart: {call} does not broadcast rank 0's "
            "weights when it takes the model, as DDP does, so a model built on each rank from its own random seed "
            "(or loaded differently) starts from different weights, and the synced gradients move every copy by "
            "the same update, so they never meet"
        )
        fix = (
            f"give every rank the same initial weights before {call}: seed alike (torch.manual_seed(0) before "
            "building the model), or copy rank 0's: `for t in [*model.parameters(), *model.buffers()]: "
            "dist.broadcast(t.data, src=0)`, or load the same checkpoint on every rank."
        )
    else:
        when = (
            f"from step {first_step} on (they agreed after step {first_step - 1})"
            if first_step
            else f"after the last of the {steps} observed steps, though they agreed after the first"
        )
        cause = (
            "something other than the synced update changed the weights on some ranks only: a write in a "
            "rank-dependent branch (a clamp, a re-initialisation, a weight copied in on rank 0), or an optimizer "
            "stepped on some ranks only"
        )
        fix = (
            "make every change to the weights outside optimizer.step() run on every rank alike (move it out of the "
            "`if rank == 0` branch), from values every rank holds."
        )
    if causes:
        cause = f"{' and '.join(causes)} {'says' if len(causes) == 1 else 'say'} why"
        fix = cause_fix(causes)
    return Finding(
        code=Code.REPLICA_DIVERGENCE,
        severity="error",
        title=f"the replicas of {_count(len(params), 'parameter')} hold different weights ({names}), {when}",
        detail=f"Under {call} {holders}, and those copies must stay equal. The local tensors of {names} differ "
        f"between the ranks that hold them, {when}: {cause}. Each rank then trains a different model, and what one "
        "rank saves is not what the others trained.",
        params=params,
        ranks=sorted({w.reference, *w.ranks}),
        more_ranks=w.more,
        steps=w.steps,
        fix=fix,
        labels={"apart_since": "start" if at_first else "step"},
        measured=[Measure("steps_observed", steps, "count")],
    )
