"""Replicas that hold different weights (`replica-divergence`), decided here for every parallelism: DDP's per-step
digests, modules the script runs beside the DDP model, the modules' train/eval modes, the replicas of a model FSDP2
replicates. Their buffers are `analyze/buffer_state.py`'s. Pure functions of the `View`, or of the facts a sharded
report agreed on."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.common import steps_of, with_evidence, with_more
from ddp_doctor.analyze.links import UNSYNCED, divergence_fix, ruled_out
from ddp_doctor.analyze.local_sgd import local_sgd
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.tree_digest import differing, same_fingerprint, step_apart
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef, lines_of
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = [
    "modes_apart",
    "modes_differ",
    "modules_beside_apart",
    "replica_divergence",
    "replicas_apart_sharded",
    "replicas_parted",
]


@detects(Code.REPLICA_DIVERGENCE, reads_found=True)
def replica_divergence(v: View, found: frozenset[str]) -> list[Finding]:
    if v.world < 2:
        return []
    params = v.summary.weight_params
    if not params.any():
        return []
    differ_steps = steps_of(v.summary.weight_steps)
    at_entry = bool(v.summary.weight_steps[0])
    after = [s - 1 for s in differ_steps if s > 0]
    gap = v.summary.weight_gap
    others = v.ranks("weight-differs")
    ranks = [0] + others.ranks
    when = "already when observe() started" if at_entry else f"after step {after[0]}"
    local = local_sgd(v)
    if local is not None and local.explains(after) and not found.intersection(UNSYNCED):
        severity, title, detail, fix = local.weights_words()
        return [
            Finding(
                code=Code.REPLICA_DIVERGENCE,
                severity=severity,
                title=title,
                detail=detail,
                fix=fix,
                params=v.params(params),
                ranks=ranks,
                steps=after,
                more_ranks=others.more,
                sites=lines_of(local.averager_site or ""),
                measured=[Measure("largest_sum_difference", gap, "abs"), *local.measured],
            )
        ]
    return [
        with_more(
            with_evidence(
                rules.replica_divergence(
                    title=f"weights of {_count(int(params.sum()), 'parameter')} differ across ranks",
                    detail=f"The replicas are no longer identical, {when}; the largest difference of a parameter's sum "
                    f"between rank 0 and another rank is {gap:.3g}. Whatever rank 0 saves is not what the other ranks "
                    "trained.",
                    params=v.params(params),
                    ranks=ranks,
                    steps=after,
                    fix=divergence_fix(found, v.summary.grads_measured),
                ),
                measured=[Measure("largest_sum_difference", gap, "abs")],
                ruled_out=ruled_out(found),
            ),
            others.more,
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


@detects(Code.REPLICA_DIVERGENCE, road="sharded")
def replicas_apart_sharded(run: ShardedRun) -> list[Finding]:
    """A sharded model's replicas apart: the local tensors of the parameters FSDP2 replicates (`replicate`, HSDP's
    replicate dimension)."""
    parallelism = parallelism_of(run.sharding)
    found = []
    if (apart := run.replicas_apart) is not None:
        mesh_dims = run.sharding.get("mesh_dims") or []
        found.append(
            replicas_parted(
                params=apart["params"],
                at_first=apart["at_first"],
                first_step=apart.get("first_step"),
                steps=run.steps,
                ranks=sorted({apart["reference"], *apart["ranks"]}),
                more=apart["more"],
                parallelism=parallelism,
                hsdp_row=apart["row"] if run.replica_rows > 1 or len(mesh_dims) > 1 else None,
            )
        )
    return found


def replicas_parted(
    *,
    params: list[ParamRef],
    at_first: bool,
    steps: int,
    ranks: list[int],
    first_step: int | None = None,
    more: int,
    parallelism: str,
    hsdp_row: int | None = None,
) -> Finding:
    """`replica-divergence` of a model whose parameters FSDP2 replicates (`replicate`, HSDP's replicate dimension):
    the local tensors of `params` differ across the ranks that hold the same one (`ranks`: the reference rank first;
    `more` others), `at_first` already after the first of the `steps` observed steps, else only after the last;
    `first_step`: the first observed step after which the copies' sums differed, where the ranks measured it.
    Neither `replicate` nor `fully_shard` broadcasts rank 0's weights when it wraps the model, as DDP does."""
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
            f"{call} does not broadcast rank 0's weights when it takes the model, as DDP does: a model built on each "
            "rank from its own random seed (or loaded differently) starts from different weights, and the synced "
            "gradients move every copy by the same update, so they never meet"
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
    return Finding(
        code=Code.REPLICA_DIVERGENCE,
        severity="error",
        title=f"the replicas of {_count(len(params), 'parameter')} hold different weights ({names}), {when}",
        detail=f"Under {call} {holders}, and those copies must stay equal. The local tensors of {names} differ "
        f"between the ranks that hold them, {when}: {cause}. Each rank then trains a different model, and what one "
        "rank saves is not what the others trained.",
        params=params,
        ranks=ranks,
        more_ranks=more,
        steps=[0] if at_first else [first_step or steps - 1],
        fix=fix,
    )
