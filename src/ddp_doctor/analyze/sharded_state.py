"""What a sharded model holds, compared across ranks or against its mixed-precision policy: its buffers, which
`fully_shard` neither shards nor broadcasts (`buffer-divergence`), the dtype of the weights its optimizer steps
(`low-precision-weights`), and its gradient shards scaled by one factor on every rank between the reduce-scatter and
the optimizer step (`grads-changed-after-sync`). Pure: the agreed facts (`ShardedRun`) in."""

from __future__ import annotations

from functools import partial

from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.moves import never_updated, nonfinite_finding, stalled
from ddp_doctor.analyze.optimizer_settings import settings_apart
from ddp_doctor.analyze.tree_state import modes_apart
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = ["buffer_divergence", "low_precision_weights", "replica_state", "shards_scaled_apart", "training_moves"]

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
    """Buffers that differ across ranks: FSDP2 shards parameters only, and neither broadcasts nor averages buffers.

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 steps (`tests/scripts/fsdp2_train.py
    --mistake buffer-rank`: a constant buffer drawn from each rank's own generator): exit code 0, nothing said, and
    the ranks' outputs on the same input end apart (sums printed by each rank). With the same seed on every rank
    (`buffer-same`) they agree.
    """
    made, running = run.buffers_made_apart, run.buffers_apart_in_training
    found = []
    steps = list(range(run.steps))  # never changed: they differed from the first step on
    if made:
        found.append(
            Finding(
                code=Code.BUFFER_DIVERGENCE,
                severity="error",
                title=f"{len(made)} buffer(s) of the sharded model differ across ranks and never changed",
                detail="fully_shard shards parameters only: a buffer stays a plain tensor on each rank, and nothing "
                "broadcasts it, as DDP does at construction. These were made different and stayed so through the "
                f"{run.steps} observed steps (a per-rank seed when they were drawn, or memory left uninitialised "
                "after to_empty()): each rank computes a different function of the same shared weights, and the "
                "gradients FSDP2 averages come from different models.",
                params=made,
                ranks=ranks,
                steps=steps,
                fix="make them equal on every rank before training: compute them from the same seed or values "
                "everywhere (after model.to_empty(...), initialise the buffers too, not only the parameters), or "
                "copy rank 0's once: `for b in model.buffers(): dist.broadcast(b, src=0)`.",
            )
        )
    if running:
        found.append(
            Finding(
                code=Code.BUFFER_DIVERGENCE,
                severity="warning",
                title=f"{len(running)} buffer(s) of the sharded model change in training and differ across ranks",
                detail="These buffers change during the steps (running statistics such as BatchNorm's), each rank "
                "from its own batches; FSDP2 neither broadcasts nor averages buffers, so evaluation differs by rank "
                "and a checkpoint holds the saving rank's.",
                params=running,
                ranks=ranks,
                steps=[run.steps - 1],  # compared at the last observed step
                fix="convert BatchNorm with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before fully_shard, "
                "or average the buffers across ranks before evaluating and saving.",
            )
        )
    return found


def shards_scaled_apart(run: ShardedRun, ranks: list[int]) -> Finding | None:
    """The ranks scaled their gradient shards by different factors between the end of the backward (FSDP2's
    reduce-scatter done) and the optimizer step: a clipping coefficient computed from each rank's own shards.

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py`):
    `clip_grad_norm_(model.parameters(), 0.05)` on every rank (a global norm) ends with head.weight summing
    -1.439474 on both ranks; the same clip from each rank's `.to_local()` shards (`--mistake local-clip`) ends at
    -1.573953, exit code 0, nothing said; `clip_grad_norm_` on rank 0 alone (`--mistake clip-rank0`) hangs (its
    norm is a collective over the DTensor gradients).
    """
    if not run.scale_differ_steps:
        return None
    steps = run.scale_differ_steps
    return Finding(
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
        "(`p.grad.to_local()`) or a clip on some ranks only does this.",
        ranks=ranks,
        steps=steps,
        measured=[
            Measure("largest_scale_ratio", run.scale_spread, "ratio"),
            Measure("steps_measured", len(run.scale_steps), "count"),
        ],
        fix="clip on every rank with torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm): with FSDP2's "
        "DTensor gradients it reduces the norm over every rank's shards and scales all of them by one coefficient. "
        "Never compute the norm from p.grad.to_local().",
    )


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
        return nonfinite_finding(grads=(steps[0], None), ranks=ranks, sharded=True, steps=steps)
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


def replica_state(run: ShardedRun) -> list[Finding]:
    """The optimizer's settings and the modules' modes of an FSDP2 or `replicate` job, compared across ranks at the
    first `INPUT_STEPS` observed steps (`ShardedRun.settings_apart`, `modes_apart`), by DDP's rules
    (`optimizer_settings.settings_apart`, `tree_state.modes_apart`).

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
    found = []
    for apart, build in ((run.settings_apart, partial(settings_apart, fix=fix)), (run.modes_apart, modes_apart)):
        if apart is not None:
            finding = build(
                step=apart["step"],
                held={int(r): v for r, v in apart["held"].items()},
                reference=apart["reference"],
                ranks=sorted({apart["reference"], *apart["ranks"]}),
                parallelism=parallelism,
            )
            found.append(with_more(finding, apart["more"]))
    return found
