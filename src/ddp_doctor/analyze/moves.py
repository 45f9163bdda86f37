"""Whether training moves at all, whatever the parallelism keeps in sync: gradients and weights are finite, the
gradients are not all exactly zero, and the optimizer's steps change the weights. Every rank counts these per step
from the fingerprints it already takes (`StepCounters.grads_zero`, ...); the exchange carries the most and the
fewest over the ranks."""

from __future__ import annotations

import math

from ddp_doctor.analyze.view import detects
from ddp_doctor.core.agreed import Agreed, NonFinite
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef
from ddp_doctor.core.ranks import rank_list

__all__ = ["never_updated", "nonfinite_finding", "nonfinite_values", "stalled", "training_stalled"]

_EXPLAINED = frozenset({Code.OPTIMIZER_PARAMS_REPLACED, Code.GRADIENT_SYNC_OFF})
"""Findings that already say why the weights do not move (the optimizer steps other tensors, gradient sync is
off): what the moves show is theirs."""


@detects(Code.NONFINITE_VALUES, reads_found=True, road="every")
def nonfinite_values(a: Agreed, found: frozenset[str]) -> list[Finding]:
    """Gradients or weights that hold NaN or infinity: nothing the optimizer does after that trains the model.

    A sharded model's gradients are measured at optimizer.step() on the tensors its optimizer holds: where those
    are not the model's, or sync is off, what they show is the finding that says so."""
    bad = a.nonfinite
    if bad is None or (a.parallelism != "ddp" and found & _EXPLAINED):
        return []
    return [nonfinite_finding(bad, ranks=list(range(a.world)), sharded=a.parallelism != "ddp")]


def nonfinite_finding(bad: NonFinite, *, ranks: list[int], sharded: bool) -> Finding:
    """`non-finite-values` from what was seen (`bad`). `sharded`: measured on the gradient shards at
    optimizer.step() (FSDP2's, `replicate`'s), and the fix names the reduce dtype."""
    grads = None if bad.grads_step is None else (bad.grads_step, bad.grads_count)
    weights = None if bad.weights_step is None else (bad.weights_step, bad.weights_count)
    before, materialised = bad.before, bad.materialised
    fed_at = bad.inputs_step
    fed = rank_list(bad.inputs_ranks, more=bad.inputs_more) if fed_at is not None else ""
    parts = []
    if grads is not None:
        step, count = grads
        held = f"the gradients of {count} parameter(s) are" if count is not None else "the gradients are"
        parts.append(f"{held} NaN or infinite from step {step}")
    if weights is not None:
        parts.append(f"{weights[1]} parameter(s) hold NaN or infinity after step {weights[0]}")
    cause = " (measured at optimizer.step(), on every rank's gradient shards)" if sharded else ""
    if materialised and not before:
        cause += (
            f" The model was materialised from the meta device with `to_empty()` ({', '.join(materialised[:2])}): its "
            "storage holds whatever the memory held until the parameters are initialised, and no initialisation "
            "made these finite."
        )
    if before:
        cause += (
            f" {before} parameter(s) already held NaN or infinity before the first step: the weights were never "
            "initialised (a model built on the meta device and materialised with `to_empty()`, whose "
            "`reset_parameters()` or initialisation was not run), or they were loaded so from a checkpoint."
        )
    if fed_at is not None:
        cause += (
            f" The training inputs of {fed} held NaN or infinity, first at step {fed_at} (a corrupt sample or a "
            f"transform that divides by zero, in that rank's data): the gradients {'FSDP2 reduces' if sharded else 'DDP averages'} "
            "carried them to every rank."
        )
    overflow = ", or a low-precision policy that overflows (reduce_dtype=torch.float32)" if sharded else ""
    return Finding(
        code=Code.NONFINITE_VALUES,
        severity="error",
        title="; ".join(parts) if parts else f"{before} parameter(s) hold NaN or infinity before the first step",
        detail="A NaN or an infinity in a gradient spreads to the weights at the optimizer's step, and from the "
        "weights to every later loss: the job runs on and learns nothing." + cause,
        params=list(bad.params),
        ranks=ranks,
        steps=bad.steps,
        measured=[
            *(
                [Measure("ranks_with_nonfinite_inputs", bad.inputs_count, "count")]
                if bad.inputs_count is not None
                else []
            ),
            Measure("first_rank_with_nonfinite_inputs", bad.inputs_ranks[0], "value"),
            Measure("step_of_nonfinite_inputs", fed_at, "value"),
        ]
        if fed_at is not None
        else [],
        fix=(
            f"find the sample in the data of {fed} from step {fed_at} (`torch.isfinite(x).all()` on each "
            "batch), and drop or repair it before the forward; one bad batch on one rank stops every rank's training"
            if fed_at is not None
            else "initialise the parameters after materialising the model (`model.to_empty(device=...)` then "
            "`model.apply(init)` or each module's `reset_parameters()`), before wrapping it"
            if before or materialised
            else "find the first non-finite value: run the step with `torch.autograd.detect_anomaly()`, lower the "
            f"learning rate, or clip the gradients; with float16, use a GradScaler{overflow}"
        )
        + ".",
    )


@detects(Code.TRAINING_STALLED, reads_found=True, road="every")
def training_stalled(a: Agreed, found: frozenset[str]) -> list[Finding]:
    """At every observed optimizer step the gradients were all exactly zero, or the weights stayed as they were
    (a learning rate of 0): one step like that is a warm-up, all of them are a job that does not train. Or some
    parameters got gradients and never moved while the rest trained (unless the weights are in a low dtype:
    `low-precision-weights` says why those lose their updates).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py`):
    a learning rate of 0 (`--mistake lr-zero`) leaves every weight where it was (largest change 0, head.weight
    -0.703294 on both ranks), exit 0; the loss multiplied by 0 (`--mistake zero-loss`) gives zero gradients, and
    only AdamW's weight decay moves the weights (largest change 0.0003), exit 0. Nothing said by torch either way.
    """
    m = a.moves
    if m is None or len(m.steps) < 2 or found & _EXPLAINED:
        return []
    ranks = list(range(a.world))
    if m.moved and not m.all_zero:
        if not m.never or Code.LOW_PRECISION_WEIGHTS in found:
            return []
        return [
            never_updated(
                params=m.never,
                held=m.never_held,
                zero_lr=m.never_zero_lr,
                optimizer=m.optimizer,
                ranks=ranks,
                steps=m.never_steps,
            )
        ]
    found_stalled = stalled(all_zero=m.all_zero, moved=m.moved, rates=m.rates, ranks=ranks, steps=m.steps)
    return [found_stalled] if found_stalled is not None else []


def stalled(*, all_zero: bool, moved: bool, rates: list[float], ranks: list[int], steps: list[int]) -> Finding | None:
    """`training-stalled`: at every one of `steps` every gradient was exactly zero (whether or not weight decay
    moved the weights), or no weight moved. `rates` are the optimizer's learning rates."""
    zero_lr = bool(rates) and all(r == 0 or (isinstance(r, float) and math.isnan(r)) for r in rates)
    n = len(steps)
    if all_zero:
        title = f"every gradient was exactly zero at all {n} observed optimizer steps: " + (
            "only weight decay moved the weights" if moved else "the weights never changed"
        )
        detail = (
            "The loss does not depend on the weights in a way that gives them a gradient: a loss that is constant, "
            "such as a cross-entropy over a single output column (the softmax of one value is always 1), a loss "
            "multiplied by 0, outputs detached from the graph before the loss, or an activation at the output "
            "that is flat for every input (a ReLU or a clamp whose input is always below its threshold)."
            + (" The optimizer's weight decay still shrinks the weights at each step, towards 0." if moved else "")
        )
        fix = (
            "check what the loss is computed from: the model's output must change with its weights (one column per "
            "class for cross_entropy, no .detach() before the loss, no output activation that is flat for every "
            "input), and the loss must not be scaled by 0."
        )
    elif moved:
        return None
    elif zero_lr:
        title = f"the optimizer's steps changed no weight at all {n} observed steps: its learning rate is 0"
        detail = (
            f"The gradients were not zero, but every param group's learning rate was {rates[0]:g}: each "
            "optimizer step leaves the weights where they were. A warm-up that starts at 0 moves them from its "
            "second step; these stayed put at every step observed."
        )
        fix = (
            "set a learning rate above 0 (or let the scheduler's warm-up reach it), and check the scheduler is stepped."
        )
    else:
        title = f"the optimizer's steps changed no weight at all {n} observed steps"
        detail = (
            "The gradients were not all zero, yet no parameter's value changed at any observed step: the optimizer "
            "holds other tensors than the model's, its updates are zero, or the weights are restored after it."
        )
        fix = (
            "check what the optimizer was built over (`model.parameters()` after the model is final) and its settings."
        )
    measured = [Measure("steps_with_all_gradients_zero", n if all_zero else 0, "count")]
    if rates:
        measured.append(Measure("largest_learning_rate", max(rates), "value"))
    return Finding(
        code=Code.TRAINING_STALLED,
        severity="error",
        title=title,
        detail=detail,
        params=[],
        ranks=ranks,
        steps=steps,
        fix=fix,
        measured=measured,
    )


def never_updated(
    *, params: list[ParamRef], held: int, zero_lr: int, optimizer: str | None, ranks: list[int], steps: list[int]
) -> Finding:
    """`training-stalled` (a warning) for some parameters only, for every parallelism: `params` had gradients other
    than 0 and their weights never changed over the observed `steps` while the others trained. `held`: how many of
    them the followed optimizer (`optimizer`, named with its line) holds; `zero_lr`: how many it holds in a param group
    whose learning rate is 0."""
    opt = f"The optimizer ({optimizer})" if optimizer else "The optimizer"
    names = ", ".join(p.name for p in params[:6]) + (f" (+{len(params) - 6} more)" if len(params) > 6 else "")
    if not held:
        cause = (
            f"{opt} does not hold them, and no other optimizer moved them: the script built it "
            "over a subset of the model's parameters. If a later phase adds them to an optimizer (a curriculum, "
            "`add_param_group`), nothing is wrong; until then they cost a gradient at every step."
        )
        fix = (
            "build the optimizer over every parameter that should train (`model.parameters()`), or set "
            "`requires_grad=False` on the ones meant to stay fixed (they then cost no gradient either)."
        )
    elif zero_lr == len(params):
        cause = f"{opt} holds them in a param group whose learning rate is 0."
        fix = "give their param group a learning rate above 0, or set `requires_grad=False` on them if they are meant to stay fixed."
    else:
        cause = (
            f"{opt} holds {held} of them, and its steps left them where they were: updates "
            "below the weights' resolution, or weights restored after each step."
        )
        fix = "check the optimizer's settings for these parameters and what writes them after the step."
    return Finding(
        code=Code.TRAINING_STALLED,
        severity="warning",
        title=f"{len(params)} parameter(s) got gradients and never changed in {len(steps)} observed steps",
        detail=f"{names} had gradients other than 0 at the observed steps, and their weights did not change on any "
        f"rank while the rest of the model trained. {cause}",
        params=params,
        ranks=ranks,
        steps=steps,
        fix=fix,
        measured=[
            Measure("parameters_never_updated", len(params), "count"),
            Measure("held_by_the_optimizer", held, "count"),
            Measure("held_at_learning_rate_0", zero_lr, "count"),
        ],
    )
