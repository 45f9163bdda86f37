"""Whether training moves at all, whatever the parallelism keeps in sync: gradients and weights are finite, the
gradients are not all exactly zero, and the optimizer's steps change the weights. Every rank counts these per step
from the fingerprints it already takes (`StepCounters.grads_zero`, ...); the exchange carries the most and the
fewest over the ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ddp_doctor.analyze.common import all_ranks
from ddp_doctor.analyze.parallelism import every_rank, optimizer_named
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.sharded_run import ShardedRun

__all__ = [
    "never_updated",
    "nonfinite_finding",
    "nonfinite_sharded",
    "nonfinite_values",
    "stalled",
    "stalled_sharded",
    "training_stalled",
]

_EXPLAINED = frozenset({Code.OPTIMIZER_PARAMS_REPLACED, Code.GRADIENT_SYNC_OFF})
"""A sharded model's findings that already say why its weights do not move (the optimizer steps other tensors,
gradient sync is off): what its moves show is theirs."""

_PRESENT, _ZERO, _NONFINITE, _MOVED, _W_NONFINITE, _INPUTS = range(6)


def _moves(v: View) -> torch.Tensor | None:
    """int64[S, 6]: the most over the ranks of each count, per common step (None: not recorded)."""
    moves = v.summary.moves
    if moves is None or not v.steps:
        return None
    return moves[0][: v.steps]


def _first(mask: torch.Tensor) -> int | None:
    hits = mask.nonzero().flatten().tolist()
    return hits[0] if hits else None


@detects(Code.NONFINITE_VALUES)
def nonfinite_values(v: View) -> list[Finding]:
    """Gradients or weights that hold NaN or infinity: nothing the optimizer does after that trains the model."""
    m = _moves(v)
    before = v.summary.nonfinite_before
    if m is None:
        return []
    scaled = torch.tensor([bool(s) for s in v.summary.scales[0][: v.steps]], dtype=torch.bool)
    # Under a GradScaler a step with non-finite gradients is skipped by design: only the weights count there.
    grad_step = _first((m[:, _NONFINITE] > 0) & ~scaled)
    weight_step = _first(m[:, _W_NONFINITE] > 0)
    if grad_step is None and weight_step is None and not before:
        return []
    positions = v.meta(0).get("nonfinite_params", [])
    # The ranks whose own batches held NaN or infinity, at or before that step: where it came from.
    input_step = _first(m[:, _INPUTS] > 0) if m.shape[1] > _INPUTS else None
    broke = min((s for s in (grad_step, weight_step) if s is not None), default=v.steps)
    fed = v.ranks("inputs-nonfinite") if input_step is not None and input_step <= broke else None
    return [
        nonfinite_finding(
            grads=None if grad_step is None else (grad_step, int(m[grad_step, _NONFINITE])),
            weights=None if weight_step is None else (weight_step, int(m[weight_step, _W_NONFINITE])),
            before=before,
            materialised=v.meta(0).get("to_empty_sites", []),
            params=v.params([i for i in positions if i < len(v.info.param_names)]),
            ranks=all_ranks(v),
            inputs=None
            if fed is None or not fed.count
            else (input_step, rank_list(fed.ranks, more=fed.more), fed.count, fed.ranks[0]),
        )
    ]


def nonfinite_finding(
    *,
    grads: tuple[int, int | None] | None,
    ranks: list[int],
    weights: tuple[int, int] | None = None,
    before: int = 0,
    materialised: Sequence[str] = (),
    params: Sequence[ParamRef] = (),
    sharded: bool = False,
    steps: list[int] | None = None,
    inputs: tuple[int, str, int | None, int] | None = None,
) -> Finding:
    """`non-finite-values`, for every parallelism: the first step whose gradients held NaN or infinity and how many
    parameters' (`grads`: the step, the count where it was counted), the first step after which weights did
    (`weights`), parameters non-finite before the first step (`before`), the lines that materialised the model
    with `to_empty()`. `sharded`: measured on FSDP2's gradient shards at optimizer.step(), and the fix names its
    reduce dtype. `steps`: the steps to list, when not the first ones of `grads` and `weights`. `inputs`: the first
    step at which some ranks' training inputs held NaN or infinity, those ranks (named), how many (None: not
    counted), the first."""
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
    if inputs is not None:
        cause += (
            f" The training inputs of {inputs[1]} held NaN or infinity, first at step {inputs[0]} (a corrupt sample or a "
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
        params=list(params),
        ranks=ranks,
        steps=steps or sorted({s for s in (grads and grads[0], weights and weights[0]) if s is not None}),
        measured=[
            *([Measure("ranks_with_nonfinite_inputs", inputs[2], "count")] if inputs[2] is not None else []),
            Measure("first_rank_with_nonfinite_inputs", inputs[3], "value"),
            Measure("step_of_nonfinite_inputs", inputs[0], "value"),
        ]
        if inputs is not None
        else [],
        fix=(
            f"find the sample in the data of {inputs[1]} from step {inputs[0]} (`torch.isfinite(x).all()` on each "
            "batch), and drop or repair it before the forward; one bad batch on one rank stops every rank's training"
            if inputs is not None
            else "initialise the parameters after materialising the model (`model.to_empty(device=...)` then "
            "`model.apply(init)` or each module's `reset_parameters()`), before wrapping it"
            if before or materialised
            else "find the first non-finite value: run the step with `torch.autograd.detect_anomaly()`, lower the "
            f"learning rate, or clip the gradients; with float16, use a GradScaler{overflow}"
        )
        + ".",
    )


@detects(Code.TRAINING_STALLED)
def training_stalled(v: View) -> list[Finding]:
    """At every observed optimizer step the gradients were all exactly zero, or the weights stayed as they were
    (a learning rate of 0). One step like that is a warm-up; all of them are a job that does not train."""
    m = _moves(v)
    if m is None:
        return []
    stepped = torch.tensor([bool(x) for x in v.summary.steps_taken[0][: v.steps]], dtype=torch.bool)
    finite = (m[:, _NONFINITE] == 0) & (m[:, _W_NONFINITE] == 0)
    steps = stepped & finite & (m[:, _PRESENT] > 0)
    if int(steps.sum()) < 2:
        return []
    all_zero = bool((m[steps, _ZERO] == m[steps, _PRESENT]).all())
    moved = bool((m[steps, _MOVED] > 0).any())
    found = stalled(
        all_zero=all_zero,
        moved=moved,
        rates=v.meta(0).get("learning_rates", []),
        ranks=all_ranks(v),
        steps=steps.nonzero().flatten().tolist(),
    )
    if found is None and moved and not all_zero and (never := v.meta(0).get("never_updated", [])):
        found = never_updated(
            params=v.params([i for i in never if i < len(v.info.param_names)]),
            held=int(v.meta(0).get("never_updated_held", 0)),
            zero_lr=int(v.meta(0).get("never_updated_zero_lr", 0)),
            optimizer=None,
            ranks=all_ranks(v),
            steps=steps.nonzero().flatten().tolist(),
        )
    return [found] if found is not None else []


@detects(Code.NONFINITE_VALUES, reads_found=True, road="sharded")
def nonfinite_sharded(run: ShardedRun, found: frozenset[str]) -> list[Finding]:
    """A sharded model's gradient shards that held NaN or infinity at an observed step, with the first step and
    lowest rank whose training inputs did."""
    if not run.grads_nonfinite_steps or found & _EXPLAINED:
        return []
    steps = run.grads_nonfinite_steps
    bad = run.inputs_nonfinite  # (the step, the lowest rank whose inputs held NaN or infinity)
    inputs = (bad[0], f"rank {bad[1]}", None, bad[1]) if bad is not None else None
    return [nonfinite_finding(grads=(steps[0], None), ranks=every_rank(run), sharded=True, steps=steps, inputs=inputs)]


@detects(Code.TRAINING_STALLED, reads_found=True, road="sharded")
def stalled_sharded(run: ShardedRun, found: frozenset[str]) -> list[Finding]:
    """Whether a sharded model trains (DDP's rule): at every measured step every gradient was exactly zero, or no
    weight moved; or some parameters got gradients and never moved while the rest trained (unless its weights are
    in a low dtype: `low-precision-weights` says why those lose their updates).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py`):
    a learning rate of 0 (`--mistake lr-zero`) leaves every weight where it was (largest change 0, head.weight
    -0.703294 on both ranks), exit 0; the loss multiplied by 0 (`--mistake zero-loss`) gives zero gradients, and
    only AdamW's weight decay moves the weights (largest change 0.0003), exit 0. Nothing said by torch either way.
    """
    measured = run.grads_measured_steps
    if found & _EXPLAINED or run.grads_nonfinite_steps:
        return []
    if len(measured) < 2 or run.steps < 2 or not run.model_params_stepped:
        return []
    low_weights = Code.LOW_PRECISION_WEIGHTS in found
    # trainable, a gradient other than 0 on some rank at some step, and weights that moved on no rank
    facts = zip(run.params, run.params_trainable, run.params_grads or [], run.params_held, run.params_zero_lr)
    never = [
        (ref, held, zero) for ref, trains, (_, nonzero, moved), held, zero in facts if trains and nonzero and not moved
    ]
    if never and run.model_changed and measured != run.grads_zero_steps and not low_weights:
        stuck = never_updated(
            params=[ref for ref, _, _ in never],
            held=sum(held for _, held, _ in never),
            zero_lr=sum(zero for _, _, zero in never),
            optimizer=optimizer_named(run),
            ranks=every_rank(run),
            steps=list(range(1, run.steps)),  # the weights' moves are measured from the first step's end
        )
        return [stuck]
    found_stalled = stalled(
        all_zero=measured == run.grads_zero_steps,
        moved=run.model_changed,
        rates=run.learning_rates,
        ranks=every_rank(run),
        steps=measured,
    )
    return [found_stalled] if found_stalled is not None else []


def stalled(*, all_zero: bool, moved: bool, rates: list[float], ranks: list[int], steps: list[int]) -> Finding | None:
    """`training-stalled`, for every parallelism (DDP's exchange here; a sharded model's report in
    `analyze/sharded.py`): at every one of `steps` every gradient was exactly zero (whether or not weight decay
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
