"""Replicas that hold different state, decided here for every parallelism: weights (`replica-divergence`: DDP's
per-step digests, the modules' train/eval modes, the replicas of a model FSDP2 replicates) and buffers
(`buffer-divergence`). Pure functions of the `View`, or of the facts a sharded report agreed on."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.common import all_ranks, steps_of, with_evidence, with_flags, with_more
from ddp_doctor.analyze.links import UNSYNCED, divergence_fix
from ddp_doctor.analyze.local_sgd import local_sgd
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.snippets import freeze_point, sync_batchnorm
from ddp_doctor.analyze.tree_state import differing, param_entry
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef, lines_of

__all__ = ["buffer_divergence", "buffers_apart", "modes_apart", "modes_differ", "replica_divergence", "replicas_parted"]


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
            ),
            others.more,
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


@detects(Code.REPLICA_DIVERGENCE)
def modes_differ(v: View) -> list[Finding]:
    """Modules in train mode on some ranks and in eval mode on others when a step closed: dropout, BatchNorm and
    any `self.training` branch compute differently there. The rule and words are every parallelism's
    (`modes_apart`)."""
    step = v.summary.state_step
    odd, modes, _ = differing(v)
    if step is None or not modes:
        return []
    held = {r: v.meta(r).get("state") or {} for r in [0, *odd]}
    return [modes_apart(step=step, held=held, reference=0, ranks=sorted({0, *odd}), parallelism="ddp")]


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


@detects(Code.BUFFER_DIVERGENCE)
def buffer_divergence(v: View) -> list[Finding]:
    """Buffers that differ across ranks at a forward: those DDP was built with (`buffer_fp`, each step), and those
    registered after it that DDP does not broadcast (`late_apart`). Ground truth: tests/sync/test_check_rank_buffers.py."""
    if v.world < 2 or not v.steps:
        return []
    broadcast = bool(v.info.ddp_config.get("broadcast_buffers", True))
    found = []
    differ = v.summary.buffer_differs & v.summary.buffer_seen  # [S, B]: every rank recorded it, and they differ
    changing = set(v.meta(0).get("buffers_changing") or [])
    apart = differ.any(0)
    moving = apart & differ.new_tensor([i in changing for i in range(len(apart))], dtype=bool)
    made = apart & ~moving
    fix_made = (
        with_flags(v, broadcast_buffers=True) + " (the default: rank 0's buffers are then broadcast before every "
        "forward), or make the buffers equal on every rank (the same seed or values everywhere) before training."
    )
    for mask, running in ((made, False), (moving, True)):
        if mask.any():
            found.append(
                buffers_apart(
                    buffers=v.buffers(mask),
                    ranks=all_ranks(v),
                    steps=steps_of(differ[:, mask].any(1)),
                    changing=running,
                    parallelism="ddp",
                    fix_ddp=fix_made
                    if not running
                    else with_flags(v, broadcast_buffers=True)
                    + " (the default)"
                    + (
                        f", or {sync} "
                        if (sync := sync_batchnorm(v.info.device_type, freeze_point(v.info.framework)))
                        else ""
                    )
                    + ".",
                    broadcast=broadcast,
                )
            )
    late = late_apart(v)
    if late:
        entries, running = late
        never = broadcast and not v.info.buffers_synced  # the flag is on, yet DDP had no buffers when built
        found.append(
            buffers_apart(
                buffers=[param_entry(e) for e in entries],
                ranks=sorted({0, *v.ranks("state-differs").ranks}),
                steps=[v.summary.state_step],
                changing=running,
                parallelism="ddp",
                fix_ddp="register these buffers before DDP is built (DDP then broadcasts rank 0's before every "
                "forward), or make them equal on every rank (the same seed or values everywhere) before training."
                if never
                else fix_made,
                broadcast=broadcast,
                none_at_wrap=never,
                late=True,
                registered_at=sorted({e["site"] for e in entries if e.get("site")}),
            )
        )
    return found


def late_apart(v: View) -> tuple[list[dict[str, Any]], bool] | None:
    """The buffers registered after DDP was built, when it does not broadcast them (broadcast_buffers=False, or no
    buffers when it was built), whose values differ between rank 0 and the example ranks whose module tree differs
    from its, and whether any of them changed between two steps. Buffers the check cannot read are left out
    (`unreadable`)."""
    mine = {e["name"]: e for e in v.meta(0).get("late_buffers") or [] if e.get("readable", True)}
    odd = v.ranks("state-differs").ranks
    if not mine or not odd or v.summary.state_step is None:
        return None
    theirs = [{e["name"]: e for e in v.meta(r).get("late_buffers") or []} for r in odd]
    apart = [e for n, e in mine.items() if any(n not in t or t[n]["fp"] != e["fp"] for t in theirs)]
    if not apart:
        return None
    return apart, any(e["changing"] or any(t.get(e["name"], {}).get("changing") for t in theirs) for e in apart)


def buffers_apart(
    *,
    buffers: list[ParamRef],
    ranks: list[int],
    steps: list[int],
    changing: bool,
    parallelism: str,
    fix_ddp: str = "",
    broadcast: bool = True,
    late: bool = False,
    registered_at: list[str] = (),
    none_at_wrap: bool = False,
    device_type: str = "",
) -> Finding:
    """`buffer-divergence`, for every parallelism: `buffers` differ across `ranks` at `steps` (`device_type`: where
    the model runs, for a sharded model's fix: SyncBatchNorm runs on GPU modules only).

    `changing`: they change during the steps (running statistics such as BatchNorm's, each rank from its own
    batches): a ``warning``, training stays correct while evaluation and the saved buffers depend on the rank.
    Otherwise they were made different and never changed (a per-rank seed, memory left uninitialised after
    `to_empty()`): an ``error``, each rank computes a different function of the same weights. DDP broadcasts rank 0's
    buffers at construction and before every forward, or never with broadcast_buffers=False (`fix_ddp` is then the
    fix in the script's framework's words); FSDP2's `fully_shard` and `replicate` take parameters only and never
    touch buffers. `late`: a DDP model's buffers registered after it was built (`registered_at`: their lines);
    `none_at_wrap`: the model had no buffers then, so DDP never syncs any (`will_sync_module_buffers`).
    """
    n = len(buffers)
    after = (
        " They were registered after DDP was built"
        + (f", at {', '.join(registered_at[:3])}." if registered_at else ".")
        if late
        else ""
    )
    if parallelism == "ddp" and not changing:
        return Finding(
            code=Code.BUFFER_DIVERGENCE,
            severity="error",
            title=f"{_count(n, 'buffer')} {'differs' if n == 1 else 'differ'} across ranks and never changed in training",
            detail=(
                "DDP was built with broadcast_buffers=False, so it never broadcasts rank 0's buffers, not even at "
                "construction. "
                if not broadcast
                else "DDP was built from a model without buffers, and DDP syncs buffers only when the model had some "
                "at construction: it never broadcasts these. "
                if none_at_wrap
                else "DDP broadcasts rank 0's buffers before each forward, yet these differed at the forward. "
            )
            + f"These were made different (a per-rank seed when they were drawn, or a value assigned on each rank) "
            f"and rank 0's copy did not change through the {len(steps)} observed step(s) where they differ: each rank "
            "computes a different function of the same synced weights, and the gradients averaged across ranks "
            "come from different models. DDP raises nothing." + after,
            sites=lines_of(*registered_at),
            params=buffers,
            ranks=ranks,
            steps=steps,
            fix=fix_ddp,
        )
    if parallelism == "ddp":
        return Finding(
            code=Code.BUFFER_DIVERGENCE,
            severity="warning",
            title=f"{_count(n, 'buffer')} {'differs' if n == 1 else 'differ'} across ranks during training",
            detail="Buffers such as BatchNorm running statistics differ between ranks when the forward pass runs"
            + (
                " because DDP was built with broadcast_buffers=False"
                if not broadcast
                else " because DDP was built from a model without buffers (it then never syncs any)"
                if none_at_wrap
                else ""
            )
            + ". Evaluation then differs by rank, and only rank 0's are saved."
            + after,
            sites=lines_of(*registered_at),
            params=buffers,
            ranks=ranks,
            steps=steps,
            fix=fix_ddp,
        )
    call = "replicate" if parallelism == "replicate" else "fully_shard"
    if changing:
        return Finding(
            code=Code.BUFFER_DIVERGENCE,
            severity="warning",
            title=f"{n} buffer(s) of the {_MODEL[parallelism]} change in training and differ across ranks",
            detail="These buffers change during the steps (running statistics such as BatchNorm's), each rank "
            f"from its own batches; {call} neither broadcasts nor averages buffers, so evaluation differs by rank "
            "and a checkpoint holds the saving rank's.",
            params=buffers,
            ranks=ranks,
            steps=steps,
            fix=f"{sync}, or average the buffers across ranks before evaluating and saving."
            if (sync := sync_batchnorm(device_type, f"before {call}"))
            else "average the buffers across ranks before evaluating and saving (SyncBatchNorm runs on GPU modules "
            "only).",
        )
    return Finding(
        code=Code.BUFFER_DIVERGENCE,
        severity="error",
        title=f"{n} buffer(s) of the {_MODEL[parallelism]} differ across ranks and never changed",
        detail=f"{call} takes parameters only: a buffer stays a plain tensor on each rank, and nothing "
        "broadcasts it, as DDP does at construction. These were made different and stayed so through the "
        f"{len(steps)} observed steps (a per-rank seed when they were drawn, or memory left uninitialised "
        "after to_empty()): each rank computes a different function of the same shared weights, and the "
        "gradients averaged across ranks come from different models.",
        params=buffers,
        ranks=ranks,
        steps=steps,
        fix="make them equal on every rank before training: compute them from the same seed or values "
        "everywhere (after model.to_empty(...), initialise the buffers too, not only the parameters), or "
        "copy rank 0's once: `for b in model.buffers(): dist.broadcast(b, src=0)`.",
    )


_MODEL = {"fsdp2": "sharded model", "replicate": "replicated model"}
