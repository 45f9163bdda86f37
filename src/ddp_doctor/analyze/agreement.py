"""Detectors of replicas that stop agreeing: a bypassed wrapper, gradients or weights or buffers that differ across
ranks at the optimizer step, and every rank training on the same batch. Pure functions of the `View`: the
differences come from the exchange's digests, the ranks from its bounded examples."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.causes import CAUSES
from ddp_doctor.analyze.common import all_ranks, steps_of, with_evidence, with_flags, with_more
from ddp_doctor.analyze.links import UNSYNCED
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.snippets import freeze_point
from ddp_doctor.analyze.tree_state import differing
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef, lines_of
from ddp_doctor.core.ranks import listed

__all__ = [
    "unsynced_steps",
    "buffer_divergence",
    "buffers_apart",
    "grads_not_synced",
    "identical_inputs",
    "modes_apart",
    "modes_differ",
    "replica_divergence",
    "wrapper_bypass",
]

_RESTART = "Restart from a checkpoint saved before the divergence, or re-broadcast rank 0's weights knowingly."


@detects(Code.WRAPPER_BYPASS)
def wrapper_bypass(v: View) -> list[Finding]:
    # A step with DDP's forward as well is not a bypass: DDP then reduces every gradient, including those of
    # modules called outside its forward (that case is used-outside-forward).
    hits = v.ranks("bypass")
    if not hits.count:
        return []
    sites = v.bypass_sites
    where = f" Called from {', '.join(sites)}." if sites else ""
    return [
        with_more(
            with_evidence(
                rules.wrapper_bypass(
                    title="the wrapped module is called directly, so DDP never synchronizes it",
                    detail="The module inside DDP ran forward in grad mode without DDP's forward around it (for example "
                    "loss = ddp_model.module(x) or a helper that unwraps the model). DDP's reducer only fires after its "
                    "own forward, so each rank trains its own replica." + where,
                    params=v.params(v.summary.bypass_used),
                    ranks=hits.ranks,
                    steps=steps_of(v.summary.bypass_steps),
                    fix="call the DDP wrapper (ddp_model(x)); if the loss needs other outputs, return them from forward. "
                    "ddp_doctor.sync_gradients is the fallback when that is impossible.",
                ),
                sites=sites,
            ),
            hits.more,
        )
    ]


def unsynced_steps(v: View, steps: list[int]) -> bool:
    """Every one of `steps` was an optimizer step on every rank, and no rank's backward in it was synced by DDP
    (every micro-batch ran under `no_sync()` or with `require_backward_grad_sync=False`)."""
    (synced_hi, _), (_, stepped_lo) = v.summary.synced, v.summary.steps_taken
    return bool(steps) and all(synced_hi[k] == 0 and stepped_lo[k] > 0 for k in steps)


@detects(Code.GRADS_NOT_SYNCED, reads_found=True)
def grads_not_synced(v: View, found: frozenset[str]) -> list[Finding]:
    if v.world < 2 or not v.steps or v.crashed_before_first_step:
        return []  # no optimizer used them; reduction-error says the reduction never finished
    # Differ at the optimizer step where every rank trains them; those that agreed after DDP's all-reduce are
    # grads-changed-after-sync's.
    params = v.summary.grad_params & ~v.summary.edited_params
    if not params.any():
        return []
    steps = steps_of(v.summary.grad_steps)
    others = v.ranks("grad-differs")  # ranks whose gradients differ from rank 0's
    ranks = [0] + others.ranks
    sites: list[str] = []  # where DDP's sync was turned off, when it was off for every backward
    why, fix = (
        "",
        (
            "see the findings that explain why (a bypassed wrapper, parameters unused with default flags, "
            "requires_grad changed after wrap); gradients must be reduced by DDP before optimizer.step()."
            if found.intersection(UNSYNCED)
            else "gradients must be reduced by DDP before optimizer.step(): check that every rank runs the backward "
            "pass through the DDP model (not its .module), with the same parameters trainable, and that nothing edits "
            ".grad between backward and the optimizer step."
        ),
    )
    if unsynced_steps(v, steps):
        sites = sorted(v.meta(0).get("nosync_sites", []))  # rank 0 differs too; its strings always travel
        flag = bool(sites) and all(site.startswith("require_backward_grad_sync") for site in sites)
        verb = "set" if flag else "entered"
        where = f" ({verb} at {'; '.join(site.split(' at ', 1)[-1] for site in sites)})" if sites else ""
        how = "with require_backward_grad_sync=False" if flag else "under no_sync()"
        why = (
            f" Every backward pass of these optimizer steps ran {how}{where}, the last micro-batch included, so "
            "DDP never reduced the gradients: each rank stepped on its own."
        )
        fix = (
            "set model.require_backward_grad_sync = True on the last micro-step of each optimizer step, as nanoGPT "
            "does: model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)"
            if flag
            else "leave the last micro-batch of each optimizer step outside no_sync(): run its forward and backward "
            "without the context manager, so DDP reduces the accumulated gradients once before optimizer.step()"
        ) + (f" (at {sites[0].split(' at ', 1)[1]})." if sites and " at " in sites[0] else ".")
    return [
        Finding(
            code=Code.GRADS_NOT_SYNCED,
            severity="error",
            title=f"gradients of {_count(int(params.sum()), 'parameter')} differ across ranks at the optimizer step"
            + (f" (DDP's sync was off for every backward: {sites[0].split(' at ', 1)[0]})" if why and sites else ""),
            detail="When the optimizer stepped, these gradients were not the same on every rank, so the replicas "
            f"take different updates. Ranks {listed(ranks, others.more)} disagree in steps {steps}.{why}",
            params=v.params(params),
            ranks=ranks,
            steps=steps,
            more_ranks=others.more,
            fix=fix,
            sites=lines_of(*sites),
        )
    ]


def _agreed(measured: dict[str, int]) -> str:
    """When the gradients were compared across the ranks, in words: what was measured, no more."""
    if measured.get("step") and measured.get("closure"):
        at = "and when optimizer.step() used them (at its start, or when a closure-based step returned)"
    elif measured.get("step"):
        at = "and when optimizer.step() began"
    elif measured.get("closure"):
        at = "and when optimizer.step() returned (its closure ran the backward inside it)"
    else:
        return "the gradients agreed after DDP's all-reduce at every step observed (no optimizer step was seen)"
    return f"the gradients agreed after DDP's all-reduce {at}, at every step observed"


def _divergence_fix(found: frozenset[str], measured: dict[str, int]) -> str:
    """What to do about replicas that differ: fix what the other findings name; when none of them explains it,
    say what was measured and which causes were looked for and not seen."""
    if Code.GRADS_NOT_SYNCED in found:
        return f"fix the cause (see grads-not-synced and the findings that explain it); {_RESTART[0].lower()}{_RESTART[1:]}"
    causes = [c for c in CAUSES if c in found]
    if causes:
        those = "that finding" if len(causes) == 1 else "those findings"
        return f"fix the cause: {', '.join(causes)} (see {those}). Then {_RESTART[0].lower()}{_RESTART[1:]}"
    agreed = _agreed(measured)
    if found.intersection(UNSYNCED):
        return (
            f"fix the cause named by the other findings; {agreed}, so the updates themselves differed (an extra "
            "synced pass on one rank, a rank-dependent optimizer setting, or weights changed outside the "
            f"optimizer). {_RESTART}"
        )
    return (
        f"the cause is unknown. {agreed[0].upper()}{agreed[1:]}, and none of the causes ddp-doctor looks for was "
        "seen: no gradients changed on some ranks after DDP's all-reduce (grads-changed-after-sync), the same "
        "optimizer settings on every rank at the steps observed (optimizer-differs), the same optimizer steps "
        "taken in lockstep (optimizer-step-skipped), identical replicas before the first step "
        "(replicas-differ-at-wrap), no write to the weights outside the optimizer on some ranks only "
        "(weights-changed-outside-optimizer). Look for what changes the weights per rank that these do not cover "
        f"(an optimizer the check did not observe, a parameter replaced rather than written in place). {_RESTART}"
    )


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
                    fix=_divergence_fix(found, v.summary.grads_measured),
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


@detects(Code.BUFFER_DIVERGENCE)
def buffer_divergence(v: View) -> list[Finding]:
    if v.world < 2 or not v.steps or not v.info.buffer_names:
        return []
    seen = v.summary.buffer_seen  # [S, B]: every rank recorded it
    differ = v.summary.buffer_differs & seen
    if not differ.any():
        return []
    broadcast = bool(v.info.ddp_config.get("broadcast_buffers", True))
    return [
        buffers_apart(
            buffers=v.buffers(differ.any(0)),
            ranks=all_ranks(v),
            steps=steps_of(differ.any(1)),
            changing=True,
            parallelism="ddp",
            fix_ddp=with_flags(v, broadcast_buffers=True) + " (the default), or convert BatchNorm with "
            f"torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) {freeze_point(v.info.framework)}.",
            broadcast=broadcast,
        )
    ]


def buffers_apart(
    *,
    buffers: list[ParamRef],
    ranks: list[int],
    steps: list[int],
    changing: bool,
    parallelism: str,
    fix_ddp: str = "",
    broadcast: bool = True,
) -> Finding:
    """`buffer-divergence`, for every parallelism: `buffers` differ across `ranks` at `steps`.

    `changing`: they change during the steps (running statistics such as BatchNorm's, each rank from its own
    batches): a ``warning``, training stays correct while evaluation and the saved buffers depend on the rank.
    Otherwise they were made different and never changed (a per-rank seed, memory left uninitialised after
    `to_empty()`): an ``error``, each rank computes a different function of the same weights. DDP broadcasts rank 0's
    buffers at construction and, with broadcast_buffers=True, before every forward (`fix_ddp` is then the fix in the
    script's framework's words); FSDP2's `fully_shard` and `replicate` take parameters only and never touch buffers.
    """
    n = len(buffers)
    if parallelism == "ddp":
        return Finding(
            code=Code.BUFFER_DIVERGENCE,
            severity="warning",
            title=f"{_count(n, 'buffer')} differ across ranks during training",
            detail="Buffers such as BatchNorm running statistics differ between ranks when the forward pass runs"
            + (" because DDP was built with broadcast_buffers=False" if not broadcast else "")
            + ". Evaluation then differs by rank, and only rank 0's are saved.",
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
            fix=f"convert BatchNorm with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before {call}, "
            "or average the buffers across ranks before evaluating and saving.",
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


@detects(Code.IDENTICAL_INPUTS_ACROSS_RANKS)
def identical_inputs(v: View) -> list[Finding]:
    if v.world < 2 or not v.steps:
        return []
    has_input = v.summary.input_present  # [S]: every rank saw an input
    if not has_input.any():
        return []
    same = ~v.summary.input_differs[has_input]
    if not bool(same.all()):
        return []
    return [same_inputs(world=v.world, steps=steps_of(has_input))]


def same_inputs(*, world: int, steps: list[int]) -> Finding:
    """`identical-inputs-across-ranks`: at every one of `steps` (those whose inputs every rank saw) the inputs were
    the same on all `world` ranks. One rule for every parallelism: DDP's exchange and a sharded model's report
    (`analyze/sharded.py`) both decide it here."""
    return Finding(
        code=Code.IDENTICAL_INPUTS_ACROSS_RANKS,
        severity="warning",
        title="every rank got the same batch",
        detail=f"In all {len(steps)} observed steps the inputs were identical on all {world} ranks, so "
        "the ranks do the same work and the job trains no faster than one rank.",
        ranks=list(range(world)),
        steps=steps,
        measured=[Measure("steps_with_identical_inputs", len(steps), "count")],
        fix="shard the data: DataLoader(dataset, sampler=DistributedSampler(dataset)), and call "
        "sampler.set_epoch(epoch) every epoch.",
    )
