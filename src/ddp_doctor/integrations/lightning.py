"""ddp-doctor for Lightning: a callback that diagnoses the first optimizer steps of `trainer.fit()`.

```python
from ddp_doctor.integrations.lightning import DoctorCallback

trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[DoctorCallback(steps=8)])
```

Lightning builds `DistributedDataParallel` in `trainer.fit()` from its strategy: `"ddp"` (find_unused_parameters
False), `"ddp_find_unused_parameters_true"`, or `DDPStrategy(find_unused_parameters=..., static_graph=...)`. The
report's fixes are phrased that way. Under `ModelParallelStrategy`, whose `configure_model` shards the model with
FSDP2's `fully_shard`, the callback follows the sharded model (`ShardedDoctor`: the optimizer's parameters, the
parameters outside every sharded group, gradient sync, torch.save of shards) and words the fixes for that
strategy. Works with `lightning.pytorch` and with `pytorch_lightning` (the callback
subclasses whichever of the two the process has imported; `lightning.pytorch` when neither is yet).

Unlike a Trainer callback in transformers, a Lightning callback hears about exceptions: when DDP itself fails
before the K steps are done (*Expected to have finished reduction*, say), every rank that failed joins a short
report that explains the failure, and the exception then goes on as usual.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Any

from ddp_doctor.core.compat import is_sharded
from ddp_doctor.core.errors import DoctorError
from ddp_doctor.doctor import Doctor, ShardedDoctor
from ddp_doctor.integrations._common import (
    JSON_NAME,
    FindingsError,
    check_fail_on,
    check_steps,
    observed_by_check,
    publish,
    raise_if_failing,
    start_doctor,
    start_sharded_doctor,
    under_check,
    unwrap_ddp,
)
from ddp_doctor.report import Report

__all__ = ["DoctorCallback", "FindingsError"]

logger = logging.getLogger(__name__)


def _callback_base() -> type:
    """`Callback` of the Lightning package in use, without importing the other one (each takes seconds)."""
    names = [n for n in ("lightning.pytorch", "pytorch_lightning") if n in sys.modules] or [
        "lightning.pytorch",
        "pytorch_lightning",
    ]
    for name in names:
        try:
            return importlib.import_module(name).Callback
        except ImportError:
            continue
    raise ImportError("ddp_doctor.integrations.lightning needs Lightning: pip install 'ddp-doctor[lightning]'")


class DoctorCallback(_callback_base()):  # type: ignore[misc]
    """Observe the first `steps` optimizer steps of `trainer.fit()` on every rank, then report once.

    The report is identical on every rank. Global rank 0 logs it (WARNING when it has findings, INFO when clean)
    and writes it as JSON (schema `ddp-doctor/report@2`) to `json_path`. Hooks are removed after the K steps.

    Args:
        steps: optimizer steps to observe (with `accumulate_grad_batches`, one step is all its micro-batches).
        fail_on: `"error"` (default), `"warning"` or `"never"`: after writing the report, raise `FindingsError` on
            every rank when it has a finding of that severity or worse.
        json_path: where to write the JSON; default `trainer.default_root_dir/ddp_doctor.json`.
        timeout: seconds each rank waits for the others to join the report.
        crash_timeout: the same, when the report follows an exception (a rank that did not fail is not coming).

    Attributes:
        report: the `Report`, once written (None before).

    Raises:
        InvalidArgumentError: `steps` or `fail_on` has an unusable value.
        FindingsError: from `trainer.fit()`, when the report has findings at or above `fail_on`.

    Example:
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[DoctorCallback(steps=8)])
        >>> trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        steps: int = 8,
        fail_on: str = "error",
        *,
        json_path: str | Path | None = None,
        timeout: float = 300.0,
        crash_timeout: float = 15.0,
    ) -> None:
        super().__init__()
        self.steps = check_steps(steps)
        self.fail_on = check_fail_on(fail_on)
        self.json_path = json_path
        self.timeout = timeout
        self.crash_timeout = crash_timeout
        self.report: Report | None = None
        self._doctor: Doctor | ShardedDoctor | None = None
        self._reported = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._doctor, self._reported, self.report = None, False, None
        if is_sharded(pl_module):  # ModelParallelStrategy: configure_model called fully_shard
            if under_check():
                logger.info("ddp-doctor: `ddp-doctor check` observes this model already; DoctorCallback stands by.")
                return
            self._doctor = start_sharded_doctor(pl_module, framework="lightning", steps=self.steps)
            return
        ddp = unwrap_ddp(trainer.strategy.model)
        if ddp is None:
            logger.warning(
                "ddp-doctor: strategy %s neither wrapped the model in DistributedDataParallel nor sharded it with "
                'FSDP2, so there is nothing to observe; DoctorCallback diagnoses DDP (strategy="ddp") and FSDP2 '
                "(ModelParallelStrategy, fully_shard in configure_model).",
                type(trainer.strategy).__name__,
            )
            return
        if observed_by_check(ddp):
            logger.info("ddp-doctor: `ddp-doctor check` observes this model already; DoctorCallback stands by.")
            return
        self._doctor = start_doctor(ddp, framework="lightning", steps=self.steps)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._doctor is not None and self._doctor.finished and not self._reported:
            self._report(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._doctor is not None and not self._reported:
            self._doctor.stop()
            if isinstance(self._doctor, ShardedDoctor) and self._doctor.steps_observed == 0:
                logger.info("ddp-doctor: fit() made no optimizer step, so there is nothing to report.")
                self._doctor, self._reported = None, True
                return
            self._report(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._doctor is None or self._reported or isinstance(exception, FindingsError):
            return
        if isinstance(self._doctor, ShardedDoctor):
            # A sharded job's failure (a collective some ranks entered alone) leaves the others waiting in it: no
            # exchange would complete. The check names it from every rank's files.
            self._doctor.stop()
            self._doctor, self._reported = None, True
            logger.warning(
                "ddp-doctor: rank %d failed with %s: %s. Run `ddp-doctor check` on the script for a per-rank "
                "account of a sharded job's failure.",
                trainer.global_rank,
                type(exception).__name__,
                str(exception)[:200],
            )
            return
        self._doctor.record_crash(exception)
        self._doctor.stop()
        try:
            self._report(trainer, timeout=self.crash_timeout, fail=False)
        except DoctorError as exc:
            logger.warning(
                "ddp-doctor: rank %d failed with %s: %s, and the ranks could not exchange their "
                "observations (%s). Run `ddp-doctor check` on the script for a per-rank account.",
                trainer.global_rank,
                type(exception).__name__,
                str(exception)[:200],
                exc,
            )

    def _report(self, trainer: Any, *, timeout: float | None = None, fail: bool = True) -> None:
        assert self._doctor is not None
        # Keep no reference to the DDP model from here on: a DDP model that outlives its process group makes gloo
        # abort at interpreter exit (torch 2.13, CPU).
        doctor, self._doctor = self._doctor, None
        self._reported = True
        report = doctor.report(timeout=self.timeout if timeout is None else timeout)
        self.report = report
        path = Path(self.json_path) if self.json_path else Path(trainer.default_root_dir) / JSON_NAME
        publish(report, logger=logger, json_path=path, is_main=bool(trainer.is_global_zero))
        if fail:
            raise_if_failing(report, self.fail_on, where=str(path))
