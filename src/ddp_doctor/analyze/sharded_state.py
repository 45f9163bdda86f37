"""What a sharded model holds, compared across ranks or against its mixed-precision policy: its buffers, which
`fully_shard` neither shards nor broadcasts (`buffer-divergence`), and the dtype of the weights its optimizer steps
(`low-precision-weights`). Pure: the agreed facts (`ShardedRun`) in."""

from __future__ import annotations

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.sharded_run import ShardedRun

__all__ = ["buffer_divergence", "low_precision_weights"]

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
