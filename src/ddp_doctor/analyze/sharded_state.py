"""What a sharded model holds, compared across ranks or against its mixed-precision policy: its buffers, which
`fully_shard` neither shards nor broadcasts (`buffer-divergence`), the dtype of the weights its optimizer steps
(`low-precision-weights`). Pure: the agreed facts (`ShardedRun`) in."""

from __future__ import annotations

from functools import partial
from typing import Any

from ddp_doctor.analyze.buffer_state import buffers_apart
from ddp_doctor.analyze.collective_order import sequences_apart
from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.moves import never_updated, nonfinite_finding, stalled
from ddp_doctor.analyze.optimizer_settings import metric_scheduler_words, settings_apart
from ddp_doctor.analyze.replica_state import modes_apart, replicas_parted
from ddp_doctor.analyze.shapes import trainable_apart_at_step
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = ["buffer_divergence", "low_precision_weights", "replica_state", "training_moves"]

_LOW = ("bfloat16", "float16")


def low_precision_weights(run: ShardedRun, ranks: list[int]) -> Finding | None:
    """A policy whose param_dtype is the low dtype the sharded weights already have: the model was cast before
    `fully_shard`, so the optimizer steps low-precision weights (FSDP2 keeps a sharded parameter in its own dtype).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps at lr 1e-4
    (`tests/scripts/fsdp2_mixed.py`): with the policy on a float32 model (`--policy bf16`) every weight of the first
    layer changed; with the model cast to bfloat16 first (`--policy bf16-weights`) 89.3% of them never changed (the
    updates were below bfloat16's resolution). Both exit 0.
    """
    policy = run.sharding.get("param_dtype") or []
    if not policy or not run.weights_dtype or not set(run.weights_dtype) <= set(policy) & set(_LOW):
        return None
    dtype = "/".join(run.weights_dtype)
    return Finding(
        code=Code.LOW_PRECISION_WEIGHTS,
        severity="warning",
        title=f"the optimizer steps {dtype} weights, the dtype the mixed-precision policy computes in",
        detail=f"The mixed-precision policy (param_dtype={'/'.join(policy)}) computes in {dtype}, and the sharded "
        f"weights the optimizer steps are {dtype} as well: fully_shard keeps each parameter in the dtype it had "
        "when it took it, and the policy only casts copies for forward and backward. An update smaller than a "
        f"weight's resolution in {dtype} (about 1/{256 if dtype == 'bfloat16' else 2048} of its size) is lost; "
        "with a small learning rate or late in training, most weights stop moving.",
        ranks=ranks,
        steps=list(range(run.steps)),
        fix=f"keep the model in float32 until fully_shard (drop the cast to {dtype} before it): the policy's "
        f"param_dtype={dtype} still computes in {dtype}, and the optimizer steps float32 weights. If training in "
        f"pure {dtype} is meant, use an optimizer made for it (stochastic rounding or Kahan summation).",
    )


def buffer_divergence(run: ShardedRun, ranks: list[int]) -> list[Finding]:
    """Buffers that differ across ranks: FSDP2 shards parameters only, and neither broadcasts nor averages buffers
    (`buffer_state.buffers_apart` words it, for every parallelism).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 steps (`tests/scripts/fsdp2_train.py
    --mistake buffer-rank`: a constant buffer drawn from each rank's own generator): exit code 0, nothing said, and
    the ranks' outputs on the same input end apart (sums printed by each rank). With the same seed on every rank
    (`buffer-same`) they agree.
    """
    parallelism = parallelism_of(run.sharding)
    found = []
    if run.buffers_made_apart:  # never changed: they differed from the first step on
        found.append(
            buffers_apart(
                buffers=run.buffers_made_apart,
                ranks=ranks,
                steps=list(range(run.steps)),
                changing=False,
                parallelism=parallelism,
            )
        )
    if run.buffers_apart_in_training:  # compared at the last observed step
        found.append(
            buffers_apart(
                buffers=run.buffers_apart_in_training,
                ranks=ranks,
                steps=[run.steps - 1],
                changing=True,
                parallelism=parallelism,
                device_type=(run.sharding or {}).get("device_type", ""),
            )
        )
    return found


def training_moves(run: ShardedRun, ranks: list[int], *, low_weights: bool = False) -> Finding | None:
    """Whether a sharded model trains at all (DDP's rule, `analyze/moves.py`): its gradient shards held NaN or
    infinity at a step; or at every measured step every gradient was exactly zero, or no weight moved.

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py`):
    a learning rate of 0 (`--mistake lr-zero`) leaves every weight where it was (largest change 0, head.weight
    -0.703294 on both ranks), exit 0; the loss multiplied by 0 (`--mistake zero-loss`) gives zero gradients, and
    only AdamW's weight decay moves the weights (largest change 0.0003), exit 0. Nothing said by torch either way.
    """
    if run.grads_nonfinite_steps:
        steps = run.grads_nonfinite_steps
        bad = run.inputs_nonfinite  # (the step, the lowest rank whose inputs held NaN or infinity)
        inputs = (bad[0], f"rank {bad[1]}", None, bad[1]) if bad is not None else None
        return nonfinite_finding(grads=(steps[0], None), ranks=ranks, sharded=True, steps=steps, inputs=inputs)
    measured = run.grads_measured_steps
    if len(measured) < 2 or run.steps < 2 or not run.model_params_stepped:
        return None
    # Weights in a low dtype lose updates below their resolution: `low-precision-weights` says so, and why.
    if run.never_updated and run.model_changed and measured != run.grads_zero_steps and not low_weights:
        where = f"{run.optimizer} created at {run.optimizer_site}" if run.optimizer_site else run.optimizer
        return never_updated(
            params=run.never_updated,
            held=run.never_updated_held,
            zero_lr=run.never_updated_zero_lr,
            optimizer=where,
            ranks=ranks,
            steps=list(range(1, run.steps)),  # the weights' moves are measured from the first step's end
        )
    return stalled(
        all_zero=measured == run.grads_zero_steps,
        moved=run.model_changed,
        rates=run.learning_rates,
        ranks=ranks,
        steps=measured,
    )


def _build(build: Any, apart: dict[str, Any], parallelism: str) -> Finding:
    """`build`'s finding from what `ShardedRun.settings_apart` / `modes_apart` holds."""
    return build(
        step=apart["step"],
        held={int(r): v for r, v in apart["held"].items()},
        reference=apart["reference"],
        ranks=sorted({apart["reference"], *apart["ranks"]}),
        parallelism=parallelism,
    )


def _frozen_apart(entries: Any) -> bool:
    """Whether the ranks' modes entries (`tree_scan.modes_of`) differ in which parameters require a gradient."""
    return len({(tuple(e.get("frozen") or []), e.get("frozen_count", 0)) for e in entries}) > 1


def _modes_apart(entries: Any) -> bool:
    """Whether they differ in the modules' train/eval modes."""
    return len({(e.get("training"), tuple(e.get("other_mode") or []), e.get("other_mode_count")) for e in entries}) > 1


def replica_state(run: ShardedRun) -> list[Finding]:
    """The optimizer's settings and the modules' modes of an FSDP2 or `replicate` job, compared across ranks at the
    first `INPUT_STEPS` observed steps (`ShardedRun.settings_apart`, `modes_apart`), by DDP's rules
    (`optimizer_settings.settings_apart`, `replica_state.modes_apart`).

    Ground truth for the sharded road, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps
    (`tests/scripts/fsdp2_train.py`):
    - `--mistake sched-rank0` (a StepLR with gamma 0.5 stepped on rank 0 alone from the third step): exit 0, nothing
      said; the last learning rate is 9.77e-06 on rank 0 and 0.01 on rank 1, and the gathered head.weight sums to
      -0.952121 (-1.060282 with the scheduler stepped on every rank): each rank stepped its own shard of every
      parameter at its own rate.
    - `--mistake train-rank0` (a Dropout in the first block; an evaluation in eval mode on every rank after the third
      step, then `model.train()` on rank 0 alone): exit 0, nothing said; rank 1 trains on in eval mode (dropout off),
      head.weight sums to -1.407930 (-1.468885 with every rank back in train mode).
    """
    parallelism = parallelism_of(run.sharding)
    fix = (
        "set every optimizer hyperparameter identically on every rank (an LR scheduler stepped on some ranks only "
        "does this: step it on every rank)."
    )
    settings = partial(settings_apart, fix=fix)
    if run.metric_schedulers:
        where, fix = metric_scheduler_words(run.metric_schedulers)
        settings = partial(settings_apart, where=where, fix=fix, sites=tuple(run.metric_schedulers))
    found = []
    modes = run.modes_apart
    if modes is not None and _frozen_apart(modes["held"].values()):
        found.append(with_more(_build(trainable_apart_at_step, modes, parallelism), modes["more"]))
        if not _modes_apart(modes["held"].values()):
            modes = None  # only which parameters train differs, not the modules' modes
    for apart, build in ((run.settings_apart, settings), (modes, modes_apart)):
        if apart is not None:
            found.append(with_more(_build(build, apart, parallelism), apart["more"]))
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
    if (apart := run.collectives_apart) is not None:
        held = {int(r): calls for r, calls in apart["held"].items()}
        calls = {r: held[r] for r in (apart["reference"], *apart["ranks"]) if r in held}
        found.append(sequences_apart(step=apart["step"], calls=calls, odd=apart["ranks"], more=apart["more"]))
    return found
