"""The stable finding codes (the JSON contract). A code may be added; none may be renamed."""

from __future__ import annotations

__all__ = ["CODES", "SEVERITIES"]

SEVERITIES = ("error", "warning", "info")

CODES: dict[str, str] = {
    "unused-parameters": "trainable parameters that never reach the loss",
    "dynamic-graph": "the set of parameters that reach the loss changes between steps",
    "rank-dependent-graph": "the set of parameters that reach the loss differs between ranks",
    "used-outside-forward": "parameters used in the loss outside DDP's forward",
    "find-unused-unneeded": "find_unused_parameters=True while every parameter is used",
    "static-graph-unsafe": "static_graph=True while the graph changes between steps",
    "reentrant-checkpoint": "reentrant activation checkpointing inside DDP",
    "wrapper-bypass": "the wrapped module is called directly, so DDP never syncs",
    "grads-not-synced": "gradients differ across ranks when the optimizer steps",
    "replica-divergence": "weights differ across ranks",
    "buffer-divergence": "buffers differ across ranks",
    "frozen-after-wrap": "requires_grad set to False after DDP was built",
    "unfrozen-after-wrap": "requires_grad set to True after DDP was built",
    "identical-inputs-across-ranks": "every rank got the same batch",
    "reduction-error": "DDP crashed with 'Expected to have finished reduction', explained",
    "no-trainable-parameters": "no parameter requires a gradient",
    # Added with `ddp-doctor check`, which runs whole scripts:
    "rank-crashed": "a rank died with an error that is not DDP's; the others were stopped",
    "rank-hung": "a rank stopped making progress and the others waited for it",
    # Added in the second round (DESIGN.md section 2.3 names them):
    "grad-blocked": "a module ran in forward but no gradient reaches its parameters (no_grad, detach, checkpoint)",
    "model-not-wrapped": "an optimizer trains parameters on several ranks with no DDP around them",
    "collective-mismatch": "ranks issued different collectives, or different numbers of synced backward passes",
    "uneven-inputs": "ranks have different numbers of batches per epoch",
    "sampler-epoch-not-set": "a shuffling DistributedSampler starts a new epoch without set_epoch",
    "rank-exited": "a rank left the job early (any exit status) while the others still trained",
    # Cheap cross-rank checks of the training loop's helpers:
    "batchnorm-not-synced": "BatchNorm layers train on each rank's batch alone (no SyncBatchNorm)",
    "grad-scaler-mismatch": "AMP GradScaler's scale differs across ranks at an optimizer step",
    # Added in the third round: why replicas diverge when the gradients agree.
    "optimizer-differs": "the optimizers' settings (a hyperparameter, the groups, a scheduler's lr) differ across ranks",
    "optimizer-step-skipped": "in one lockstep iteration some ranks called optimizer.step() and others did not",
    "grads-reduced-twice": "the script reduces gradients that DDP has already reduced",
    "replicas-differ-at-wrap": "the replicas differ before the first step (init_sync=False, a per-rank seed)",
    "weights-changed-outside-optimizer": "parameters changed on some ranks only, outside the optimizer",
    # Added in the fourth round (issue #32): gradients that DDP synchronized, changed on some ranks before the step.
    "grads-changed-after-sync": "gradients agreed after DDP's all-reduce but differ at optimizer.step() (edited on "
    "some ranks only, e.g. clip_grad_norm_ under if rank == 0)",
    # Added with issue #27 (what happens at wrap and at epoch ends):
    "param-shapes-differ": "parameters have different shapes on different ranks when DDP is built",
    "checkpoint-same-path": "several ranks wrote the same file with torch.save (no rank guard)",
    "checkpoint-module-prefix": "the DDP wrapper's state dict (keys 'module.*') was saved",
    "timeout-risk": "a rank works alone while the others wait in a collective, long enough to reach the timeout",
    # Where the step time goes (measurements on this machine):
    "input-bound": "the ranks spend a large share of every step waiting for the next batch",
    "straggler-rank": "one rank is consistently slower and the others wait for it in the gradient all-reduce",
    # Issue #32 (never confidently wrong):
    "backward-passes-differ": "two backward passes through one DDP forward reach different parameters (a GAN)",
    # Data parallelism beyond DDP: FSDP2 (`fully_shard`).
    "optimizer-params-replaced": "the optimizer holds parameters that fully_shard replaced: it updates none of the model's",
    "unsharded-params-not-synced": "parameters outside every fully_shard group train on each rank with nothing to sync them",
    "gradient-sync-off": "gradient sync was off (set_requires_gradient_sync(False)) at every optimizer step",
}
