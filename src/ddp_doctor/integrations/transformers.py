"""ddp-doctor for the Hugging Face `Trainer`: a callback that diagnoses the first optimizer steps of `train()`.

```python
from ddp_doctor.integrations.transformers import DoctorCallback

trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[DoctorCallback(steps=8)])
trainer.train()   # after 8 optimizer steps: the report in the log and in output_dir/ddp_doctor.json
```

The Trainer builds `DistributedDataParallel` inside `train()` (through Accelerate), with flags taken from
`TrainingArguments`: `ddp_find_unused_parameters` (when unset: True for a `PreTrainedModel` without gradient
checkpointing, so most users pay for the autograd-graph walk without knowing), `ddp_static_graph` (recent
versions only), `ddp_bucket_cap_mb` and `ddp_broadcast_buffers`. The report's fixes are phrased as those fields;
where the installed version has no field for a flag, the fix says so and shows the working route.

Limits: a callback sees no exception, so if DDP crashes before the K steps are done (for example with *Expected
to have finished reduction*), no report is written; `ddp-doctor check` on the same script explains such crashes.
Under `ddp-doctor check` the callback stands by, since the launcher already observes the model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover  (the extra is not installed)
    raise ImportError(
        "ddp_doctor.integrations.transformers needs the transformers package: pip install 'ddp-doctor[transformers]'"
    ) from exc

from ddp_doctor.doctor import Doctor
from ddp_doctor.integrations._common import (
    JSON_NAME,
    FindingsError,
    check_fail_on,
    check_steps,
    find_ddp,
    observed_by_check,
    publish,
    raise_if_failing,
    start_doctor,
)
from ddp_doctor.report import Report

__all__ = ["DoctorCallback", "FindingsError"]

logger = logging.getLogger(__name__)


class DoctorCallback(TrainerCallback):
    """Observe the first `steps` optimizer steps of `Trainer.train()` on every rank, then report once.

    The report is identical on every rank. The main process logs it (WARNING when it has findings, INFO when
    clean) and writes it as JSON (schema `ddp-doctor/report@2`) to `output_dir/ddp_doctor.json`. Hooks are removed
    after the K steps, so the rest of training runs at full speed.

    Args:
        steps: optimizer steps to observe (with gradient accumulation, one step is all its micro-batches).
        fail_on: `"error"` (default), `"warning"` or `"never"`: after writing the report, raise `FindingsError` on
            every rank when it has a finding of that severity or worse, so a broken run stops early.
        timeout: seconds each rank waits for the others to join the report.

    Attributes:
        report: the `Report`, once written (None before).

    Raises:
        InvalidArgumentError: `steps` or `fail_on` has an unusable value.
        FindingsError: from `train()`, when the report has findings at or above `fail_on`.

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[DoctorCallback(steps=8)])
        >>> trainer.train()
    """

    def __init__(self, steps: int = 8, fail_on: str = "error", *, timeout: float = 300.0) -> None:
        self.steps = check_steps(steps)
        self.fail_on = check_fail_on(fail_on)
        self.timeout = timeout
        self.report: Report | None = None
        self._doctor: Doctor | None = None
        self._reported = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._doctor, self._reported, self.report = None, False, None
        if not (dist.is_available() and dist.is_initialized()):
            logger.info("ddp-doctor: not a distributed run (no process group), so there is no DDP to observe.")
            return
        # The callback is handed Trainer.model, the inner model; the Trainer wrapped it in DDP just before this.
        ddp = find_ddp(model) if model is not None else None
        if ddp is None:
            logger.warning(
                "ddp-doctor: the Trainer did not wrap %s in DistributedDataParallel (parallel mode %s), "
                "so there is nothing to observe; DoctorCallback diagnoses DDP only.",
                type(model).__name__,
                getattr(args, "parallel_mode", "?"),
            )
            return
        if observed_by_check(ddp):
            logger.info("ddp-doctor: `ddp-doctor check` observes this model already; DoctorCallback stands by.")
            return
        self._doctor = start_doctor(ddp, framework="transformers", steps=self.steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._doctor is not None and self._doctor.finished and not self._reported:
            self._report(args, state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Fewer optimizer steps than `steps` in the whole run: report what there was.
        if self._doctor is not None and not self._reported:
            self._doctor.stop()
            self._report(args, state)

    def _report(self, args: Any, state: Any) -> None:
        assert self._doctor is not None
        # Keep no reference to the DDP model from here on: a DDP model that outlives its process group makes gloo
        # abort at interpreter exit (torch 2.13, CPU).
        doctor, self._doctor = self._doctor, None
        self._reported = True
        report = doctor.report(timeout=self.timeout)
        self.report = report
        output_dir = getattr(args, "output_dir", None)
        path = Path(output_dir) / JSON_NAME if output_dir else None
        publish(report, logger=logger, json_path=path, is_main=bool(state.is_world_process_zero))
        raise_if_failing(report, self.fail_on, where=str(path) if path else "the log")
