"""Epoch-end work a framework schedules by counting batches against a loader's real length, which a capped pass
never reaches: following tells the framework how long the capped pass is, the way the framework's own batch limit
would have. Local facts only; nothing here communicates.

Lightning validates "at the end of each epoch" (`val_check_interval=1.0`, the default) by counting: the training
epoch loop runs the validation loop after the batch where `(batch_idx + 1) % trainer.val_check_batch == 0`, and
`val_check_batch` is computed once, when fit starts, from `len()` of the training loader (`max_batches *
val_check_interval`). A pass capped by `check` ends earlier (its next batch raises StopIteration and the epoch loop
breaks), so without this the followed epoch end has no validation. Each capped training pass sets `val_check_batch`
to the batches it hands out, as `Trainer(limit_train_batches=...)` would have; a pass not cut short gets Lightning's
value back. Only where the real run validates at its epochs' last batch (a length, validation counted per epoch,
`max_batches` a multiple of `val_check_batch`): a time-based interval, validation every N batches across epochs,
or a loader without a length (Lightning then prefetches a batch and validates when the pass ends) are left alone.

The HF Trainer evaluates from its `on_epoch_end` callback, after its epoch loop, and Accelerate leaves the epoch end
to the script: neither counts, neither needs this.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.observation.dataloaders import Pass

__all__ = ["LightningEpochs"]


class LightningEpochs:
    """Keeps a Lightning Trainer validating at the end of capped training passes (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.original: int = trainer.val_check_batch

    @classmethod
    def of(cls, ddp: DistributedDataParallel) -> LightningEpochs | None:
        """The helper for the Lightning Trainer that built `ddp`; None when Lightning did not, or does not validate
        at its epochs' last batch."""
        # Lightning 2.x wraps the LightningModule itself; older releases put a _LightningModuleWrapperBase around it.
        module = ddp.module
        trainer = getattr(module, "_trainer", None) or getattr(getattr(module, "module", None), "_trainer", None)
        if not type(trainer).__module__.startswith(("lightning.", "pytorch_lightning.")):
            return None
        every = getattr(trainer, "val_check_batch", None)
        batches = getattr(getattr(trainer, "fit_loop", None), "max_batches", None)
        if (
            not isinstance(every, int)  # None: a time-based interval; inf: no length
            or every < 1
            or getattr(trainer, "check_val_every_n_epoch", None) is None  # counted across epochs
            or not isinstance(batches, int)
            or batches % every
        ):
            return None
        return cls(trainer)

    def on_step(self, training: Pass) -> None:
        """An optimizer step on `training`'s batch while following."""
        real = training.info.get("batches")
        short = training.cap is not None and (real is None or training.cap < real)
        self.trainer.val_check_batch = training.cap if short else self.original
