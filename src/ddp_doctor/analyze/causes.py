"""Why replicas diverge when the gradients agree after DDP's all-reduce: the script changes them on some ranks
before the optimizer step, some ranks skip a step, the script reduces DDP's gradients again (the optimizers' settings
that disagree are `optimizer_settings.py`'s; weights written other than by the optimizer, `weight_writes.py`'s).
Pure functions of the `View`.

Iterations are aligned by what the ranks do in lockstep, DDP's synced backward passes (`Summary.synced`), never by
each rank's own count of optimizer steps: a rank that skips `optimizer.step()` is one update behind, not one
collective ahead.
"""

from __future__ import annotations

from ddp_doctor.analyze.common import meta_sites, steps_of, with_more
from ddp_doctor.analyze.parallelism import every_rank
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.sharded_run import ShardedRun

__all__ = [
    "CAUSES",
    "SKIP_FIX",
    "grads_changed_after_sync",
    "grads_reduced_twice",
    "shards_scaled_apart",
    "optimizer_step_skipped",
    "sharded_step_skipped",
]

SKIP_FIX = (
    "decide the skip (or the retry) from a value all-reduced across ranks, so every rank takes the same decision: "
    "flag = torch.tensor(float(skip)); dist.all_reduce(flag, op=dist.ReduceOp.MAX); skip = flag.item() > 0."
)
"""The fix of `optimizer-step-skipped`, whatever the parallelism."""

CAUSES = (
    Code.GRADS_CHANGED_AFTER_SYNC,
    Code.OPTIMIZER_DIFFERS,
    Code.OPTIMIZER_STEP_SKIPPED,
    Code.REPLICAS_DIFFER_AT_WRAP,
    Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER,
)
"""The codes that explain a `replica-divergence` whose gradients agreed after DDP's all-reduce."""


def extra_pass(v: View) -> bool:
    """Ranks that ran more synced passes than the others in an optimizer step did so by design, not by skipping a
    step: in every observed step (micro-batches accumulated with sync on, more of them on some ranks), or through a
    forward at a line where none of their steps began (an auxiliary objective's backward on some ranks; a skipped
    step's next forward runs where steps begin: the example ranks' strings say). `collective-mismatch` then, not
    `optimizer-step-skipped`."""
    most_by, least_by = v.summary.window_passes
    if v.summary.windows >= 2 and all(most_by[k] != least_by[k] for k in range(v.summary.windows)):
        return True
    skipped = v.ranks("skipped-step").ranks
    repeats, firsts = meta_sites(v, skipped, "skip_sites"), meta_sites(v, skipped, "step_sites")
    return bool(repeats and firsts) and not set(repeats) & set(firsts)


@detects(Code.OPTIMIZER_STEP_SKIPPED)
def optimizer_step_skipped(v: View) -> list[Finding]:
    """In one lockstep iteration some ranks called `optimizer.step()` and the others did not."""
    if v.world < 2 or not v.steps:
        return []
    (hi, lo), (shi, slo) = v.summary.steps_taken, v.summary.synced
    bad = [k for k in range(len(hi)) if hi[k] != lo[k] and shi[k] == slo[k] and slo[k] > 0]
    if not bad or extra_pass(v):  # an extra synced pass in the step: `collective-mismatch` (collective_order.py)
        return []
    first = bad[0]
    skipped = v.ranks("skipped-step")
    scaler = any(v.summary.scales[0])
    who = "their GradScaler skipped it, or the script did" if scaler else "the script skipped it"
    sites = meta_sites(v, skipped.ranks, "skip_sites")
    if sites:
        who += (
            f"; their next synced forward, at {', '.join(sites)}, came without a step: a skipped update, or a "
            "retry that ran the forward and backward again before stepping"
        )
    return [
        with_more(
            Finding(
                code=Code.OPTIMIZER_STEP_SKIPPED,
                sites=lines_of(*sites),
                severity="error",
                title=f"{rank_list(skipped.ranks, more=skipped.more)} did not call optimizer.step() in iteration "
                f"{first}; the other ranks did",
                detail=f"In iteration {first} (counted by DDP's synced backward passes, which every rank runs in "
                f"lockstep), {rank_list(skipped.ranks, more=skipped.more)} took no optimizer step ({who}) while the "
                "other ranks stepped. DDP had averaged the gradients, so they were the same everywhere: the "
                "replicas now hold different weights, one update apart, and every later step starts from "
                "different weights. A decision taken from each rank's own loss or gradients differs by rank."
                + (f" It happened again in iteration(s) {bad[1:]}." if len(bad) > 1 else ""),
                params=[],
                ranks=skipped.ranks,
                steps=bad,
                fix=SKIP_FIX + " (A GradScaler decides from DDP's reduced gradients, alike on every rank, unless "
                "something edits the gradients per rank after the backward.)",
            ),
            skipped.more,
        )
    ]


def _group_size(signature: str) -> int | None:
    """2 from `all_reduce(float32[16, 8], SUM)/2`: the size of the group the collective ran over, if recorded."""
    group = signature.rsplit("/", 1)[-1]
    return int(group) if group.isdigit() else None


def _factor(signature: str) -> tuple[str, int | None]:
    """(`SUM`, 2) from `all_reduce(float32[16, 8], SUM)/2`; the reduction defaults to SUM for a reducing op."""
    op = signature.split("(", 1)[0]
    inner = signature[signature.find("(") + 1 : signature.rfind(")")] if "(" in signature else ""
    size = _group_size(signature)
    reduction = inner.rsplit(", ", 1)[-1] if ", " in inner and not inner.rsplit(", ", 1)[-1][0].isdigit() else ""
    if op in ("all_reduce", "reduce"):
        reduction = reduction or "SUM"
        if reduction == "SUM":
            return reduction, size
        if reduction == "AVG":
            return reduction, 1
    return reduction or op, None


def _rereduced(signature: str, factor: int | None) -> list[Measure]:
    """The evidence of gradients reduced again: the factor they were multiplied by (1 for an average; none when the
    collective replaces or changes them in a way not known), and the size of the group it ran over."""
    size = _group_size(signature)
    return [
        *([Measure("gradient_factor", factor, "ratio")] if factor is not None else []),
        *([Measure("group_size", size, "count")] if size is not None else []),
    ]


@detects(Code.GRADS_REDUCED_TWICE)
def grads_reduced_twice(v: View) -> list[Finding]:
    """The script ran a collective on a synced parameter's `.grad` after DDP had reduced it in that iteration."""
    hi, _ = v.summary.rereduced
    bad = [k for k, n in enumerate(hi) if n > 0]
    if not bad:
        return []
    who = v.ranks("rereduced")
    sites = meta_sites(v, who.ranks, "rereduce_sites")
    signature = sites[0].split(" at ", 1)[0] if sites else ""
    reduction, factor = _factor(signature)
    return [
        with_more(
            Finding(
                code=Code.GRADS_REDUCED_TWICE,
                sites=lines_of(*sites),
                severity="warning" if factor == 1 else "error",
                params=[],
                ranks=who.ranks,
                steps=bad,
                fix="drop the manual reduction: DDP already averages the gradients. If it is meant to replace DDP's, "
                "run the backward under ddp.no_sync(), or register a comm hook (ddp.register_comm_hook) instead.",
                measured=_rereduced(signature, factor),
                labels={"call": signature.rsplit("/", 1)[0], "reduction": reduction} if signature else {},
            ),
            who.more,
        )
    ]


@detects(Code.GRADS_CHANGED_AFTER_SYNC)
def grads_changed_after_sync(v: View) -> list[Finding]:
    """Gradients that agreed across the ranks when DDP's all-reduce finished differ when `optimizer.step()` uses
    them: code between the backward and the step (clipping, a per-rank scale, a write to `.grad`) changed them on
    some ranks only, or changed them differently."""
    s = v.summary
    if v.world < 2 or not v.steps or not s.edited_params.any():
        return []
    steps = [k for k, e in enumerate(s.edited_steps.tolist()) if e] or steps_of(s.grad_steps)
    who = v.ranks("grads-edited")
    sites = meta_sites(v, who.ranks, "grad_edit_sites")
    closure = s.grads_measured.get("closure", 0) and not s.grads_measured.get("step", 0)
    when = (
        "when optimizer.step() returned (its closure ran the backward inside it)"
        if closure
        else ("when optimizer.step() began")
    )
    editors = rank_list(who.ranks, more=who.more) if who.count else "some ranks"
    if sites:
        lines = sorted({site.rsplit(" at ", 1)[-1] for site in sites})
        how = f"{editors} called {'; '.join(sites)} between the backward and the step" + (
            ", and the other ranks did not, or not alike" if who.count < v.world else ""
        )
        fix = (
            f"call it on every rank alike: move the call at {lines[0]} out of its rank-dependent branch (to log the "
            "norm on rank 0 only, clip on every rank and print the returned norm on rank 0 only). Every rank must "
            "step on the same gradients."
        )
    else:
        how = (
            f"on {editors} the gradients were written in place or replaced (p.grad.mul_(...), p.grad = ...) between "
            "the backward and the step, and no clip_grad_norm_ or clip_grad_value_ call was seen there"
        )
        fix = (
            "make the same change on every rank (or none): anything that edits .grad after loss.backward() must "
            "run on every rank alike, from values every rank holds (all-reduce a per-rank value first)."
        )
    mask = s.edited_params
    return [
        with_more(
            Finding(
                code=Code.GRADS_CHANGED_AFTER_SYNC,
                sites=lines_of(*sites),
                severity="error",
                title=f"gradients changed on {editors} after DDP synchronized them ({v.params(mask)[0].name}"
                + (" and others)" if int(mask.sum()) > 1 else ")"),
                detail=f"The gradients of {int(mask.sum())} parameter tensor(s) were the same on every rank when "
                f"DDP's all-reduce finished, and differed {when}: {how}. The ranks then take different updates "
                f"and the replicas drift apart. Seen in step(s) {steps}.",
                params=v.params(mask),
                ranks=who.ranks,
                steps=steps,
                fix=fix,
                labels={
                    "kind": "call" if sites else "grad-write",
                    **({"call": sites[0].rsplit(" at ", 1)[0]} if sites else {}),
                    "compared_at": "step-return" if closure else "step-begin",
                },
            ),
            who.more,
        )
    ]


@detects(Code.GRADS_CHANGED_AFTER_SYNC, road="sharded")
def shards_scaled_apart(run: ShardedRun) -> list[Finding]:
    """The ranks scaled their gradient shards by different factors between the end of the backward (FSDP2's
    reduce-scatter done) and the optimizer step: a clipping coefficient computed from each rank's own shards.

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py`):
    `clip_grad_norm_(model.parameters(), 0.05)` on every rank (a global norm) ends with head.weight summing
    -1.439474 on both ranks; the same clip from each rank's `.to_local()` shards (`--mistake local-clip`) ends at
    -1.573953, exit code 0, nothing said; `clip_grad_norm_` on rank 0 alone (`--mistake clip-rank0`) hangs (its
    norm is a collective over the DTensor gradients). Its neighbours, exit code 0 and nothing said: `clip_grad_value_(
    model.parameters(), 0.01)` on rank 0 alone (`--mistake value-clip-rank0`, elementwise, no collective) -1.661447;
    each rank dividing its shards by its own batch's count of non-zero labels (`--mistake token-norm`) -1.578808,
    against -1.496532 without either.
    """
    if not run.scale_differ_steps:
        return []
    steps = run.scale_differ_steps
    finding = Finding(
        code=Code.GRADS_CHANGED_AFTER_SYNC,
        severity="error",
        title=f"the ranks scaled their gradient shards by different factors before the optimizer step (steps {steps})",
        detail="Between the end of the backward (the gradients reduced) and optimizer.step(), the ranks changed their "
        "gradient shards by "
        f"factors of their own: at step {steps[0]} one rank's shards were scaled {run.scale_spread:.3g} times as "
        f"much as another's (measured in {len(run.scale_steps)} steps: the norm of each rank's shards at the step "
        "against the same at the end of the backward). Each rank owns a different part of every parameter, so the "
        "model takes an update in which each part was clipped or scaled differently: training goes on, silently "
        "not the update the script means. A clipping coefficient computed from each rank's own shards "
        "(`p.grad.to_local()`), a clip on some ranks only (clip_grad_value_ has no collective to hang on), or a "
        "normalisation by a count or a loss of the rank's own batch (tokens per rank) does this.",
        ranks=every_rank(run),
        steps=steps,
        measured=[
            Measure("largest_scale_ratio", run.scale_spread, "ratio"),
            Measure("steps_measured", len(run.scale_steps), "count"),
        ],
        fix="scale every rank's shards by one factor: clip on every rank with "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) (with FSDP2's DTensor gradients it reduces the "
        "norm over every rank's shards), never from p.grad.to_local(); divide by a count or a loss all-reduced "
        "across the ranks (or scale the loss before backward), not by the rank's own.",
    )
    return [finding]


def sharded_step_skipped(
    skipped: dict[int, tuple[int, int]], ahead: tuple[int, int, int], *, ranks: list[int], api: str
) -> Finding:
    """`optimizer-step-skipped` of a sharded model (`api`: `fully_shard` or `replicate`), from each rank's counts
    when the run failed: `skipped` maps a rank to (its optimizer steps, its forwards through the model), `ahead` is
    (a rank that took the most steps, its steps, its forwards), all counted from each rank's first step. A rank that
    ran more forwards and took fewer steps, where the model's collectives keep the iterations in lockstep, did not
    call `optimizer.step()` in an iteration where the others did."""
    first, most, forwards = ahead
    names = sorted(skipped)
    counts = "; ".join(f"rank {r}: {n} steps over {f} forwards" for r, (n, f) in sorted(skipped.items())[:4])
    if api == "replicate":
        lockstep = "The backward passes all-reduce the gradients, so the ranks run their iterations in lockstep"
        cause = ""
        after = (
            "After a skipped step, the whole copy of the model those ranks hold is one update behind the others': "
            "the replicas differ from then on."
        )
    else:
        lockstep = "The forwards all-gather the parameters, so the ranks run them in lockstep"
        cause = ", or ran a forward the others did not"
        after = (
            "After a skipped step, the shards those ranks hold missed an update the others' got (each rank's "
            "optimizer updates its own shards), and the model's parameters mix weights one update apart."
        )
    return Finding(
        code=Code.OPTIMIZER_STEP_SKIPPED,
        severity="error",
        title=f"{rank_list(names)} took fewer optimizer steps than rank {first} over more forwards "
        f"({most} steps and {forwards} forwards on rank {first})",
        detail=f"Counted from each rank's first optimizer step, rank {first} took {most} optimizer steps over "
        f"{forwards} forwards through the model, and {counts}. {lockstep}: {rank_list(names)} skipped "
        f"optimizer.step() in an iteration where the others stepped (a skip decided from its own loss or "
        f"gradients){cause}. {after} The check ends at a count of optimizer steps, which rank {first} reached "
        "first: the ranks could not compare what they saw.",
        ranks=ranks,
        steps=[],
        measured=[
            Measure(f"optimizer_steps_rank_{first}", most, "count"),
            Measure(f"forwards_rank_{first}", forwards, "count"),
            *(m for r, (n, f) in sorted(skipped.items())[:4] for m in _rank_counts(r, n, f)),
        ],
        fix=SKIP_FIX,
    )


def _rank_counts(rank: int, steps: int, forwards: int) -> tuple[Measure, Measure]:
    return Measure(f"optimizer_steps_rank_{rank}", steps, "count"), Measure(f"forwards_rank_{rank}", forwards, "count")
