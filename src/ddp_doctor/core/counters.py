"""`StepCounters`: the per-step counts one rank keeps, one row of `RankRecord.counters` (`records.py`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepCounters"]


@dataclass(kw_only=True)
class StepCounters:
    """Per-step counts, one row of `RankRecord.counters`."""

    micro_steps: int = 0
    """Backward passes in this step (more than one under gradient accumulation)."""
    ddp_forwards: int = 0
    """Forward calls through the DDP wrapper in grad mode."""
    bypass_forwards: int = 0
    """Forward calls of the wrapped module in grad mode with no DDP forward around them."""
    reentrant_checkpoints: int = 0
    """Reentrant activation-checkpoint nodes found in the graph of DDP's outputs."""
    synced_backwards: int = 0
    """Backward passes that followed a forward with `require_backward_grad_sync=True`."""
    complete: int = 1
    """0 for the step a crash interrupted: its usage data is partial."""
    optimizer_step: int = 0
    """1 when the step ended with `optimizer.step()`."""
    unpaired_forwards: int = 0
    """Forward calls through the DDP wrapper in grad mode, with gradient sync on, that no backward followed before
    the next one (an evaluation through DDP with autograd on, say)."""
    ddp_broadcasts: int = 0
    """DDP forwards that broadcast group rank 0's buffers (`broadcast_buffers=True`, the model has buffers, and the
    previous DDP forward was a synced one in grad mode: `ddp.will_sync_module_buffers()`)."""
    eval_broadcasts: int = 0
    """Those of `ddp_broadcasts` whose forward ran without grad (an evaluation through the DDP wrapper, say)."""

    collectives: int = 0
    """The script's own `torch.distributed` collectives in this step (DDP's gradient all-reduces not included)."""
    collective_digest: int = 0
    """A running 31-bit digest of those collectives' op, dtype, shape, reduction and group size, in order
    (`collectives.digest`): equal on ranks that issued the same sequence."""

    scaler_scale: int = 0
    """AMP GradScaler's scale at the step's `scaler.step()`, as float32 bits (`encode_scale`); 0: none."""
    batch_size: int = 0
    """The first dimension of the first input tensor of the step's first training forward (0: none seen)."""
    batchnorm_training: int = 0
    """How many of the model's BatchNorm layers (not SyncBatchNorm) were in training mode at that forward."""

    optimizer_digest: int = 0
    """A 31-bit digest of the optimizer's param groups at its `step()`: every hyperparameter (lr, momentum, betas,
    weight decay, ...), the number of groups and their sizes (`observation.optimizers.describe`); 0: no step."""
    scheduler_steps: int = 0
    """Calls of an LR scheduler's `step()` on the observed optimizer in this step."""
    changed_outside: int = 0
    """Parameters whose values changed on this rank between the last optimizer step (or DDP's wrap, for step 0)
    and this step's first forward: a change no optimizer made (their tensors' in-place version counters moved)."""
    grads_rereduced: int = 0
    """The script's collectives on a synced parameter's `.grad` after DDP reduced it in this step."""
    split_passes: int = 0
    """1 when two backward passes through one DDP forward gave gradients to different parameter sets (a GAN's
    discriminator and generator losses from one forward, say): DDP prepares one reduction per forward."""
    inner_passes: int = 0
    """Backward passes that ran inside DDP's forward (Lightning's manual optimization: `manual_backward` in
    `training_step`); Lightning prepares DDP's reduction from each such pass's loss."""
    grads_measured: int = 0
    """Where `grad_fp` was taken: 1 when `optimizer.step()` began (its pre-hook), 2 when it returned (a closure-based
    step runs the backward inside it, after the pre-hook), 0 after the synced backward (no optimizer step)."""
    state_digest: int = 0
    """A 31-bit digest of what the module tree held when the step closed, beyond what DDP compares itself: every
    module's `training` flag, and every parameter DDP's reducer does not hold, with its values and `requires_grad`
    (`observation.tree_scan`): equal on ranks whose replicas hold the same such state."""
    unregistered: int = 0
    """Trainable parameters in the module tree that DDP's reducer does not hold (created or replaced after DDP was
    built), when the step closed."""
    grads_present: int = 0
    """Parameters that got a gradient in the step (as `RankRecord.used`)."""
    grads_zero: int = 0
    """Of those, the ones whose gradient the optimizer used was exactly zero."""
    grads_nonfinite: int = 0
    """Of those, the ones whose gradient held a NaN or an infinity."""
    weights_moved: int = 0
    """Parameters whose values changed between the step's start and its end."""
    weights_nonfinite: int = 0
    """Parameters holding a NaN or an infinity when the step ended."""
    inputs_nonfinite: int = 0
    """Floating-point input tensors of the step's training forwards that held a NaN or an infinity (a corrupt
    sample on this rank: DDP's all-reduce then carries it to every rank's gradients)."""
    batches_drawn: int = 0
    """Batches the DataLoader pass the step trained on handed out since the previous optimizer step (its
    `optimizer.step()`'s pre-hook: the accumulation's micro-batches, and any batch the loop skipped)."""

    FIELDS = (
        "micro_steps",
        "ddp_forwards",
        "bypass_forwards",
        "reentrant_checkpoints",
        "synced_backwards",
        "complete",
        "optimizer_step",
        "unpaired_forwards",
        "ddp_broadcasts",
        "eval_broadcasts",
        "collectives",
        "collective_digest",
        "scaler_scale",
        "batch_size",
        "batchnorm_training",
        "optimizer_digest",
        "scheduler_steps",
        "changed_outside",
        "grads_rereduced",
        "split_passes",
        "inner_passes",
        "grads_measured",
        "state_digest",
        "unregistered",
        "grads_present",
        "grads_zero",
        "grads_nonfinite",
        "weights_moved",
        "weights_nonfinite",
        "batches_drawn",
        "inputs_nonfinite",
    )

    def as_list(self) -> list[int]:
        return [getattr(self, f) for f in self.FIELDS]
