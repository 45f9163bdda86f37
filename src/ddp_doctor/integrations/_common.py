"""What the framework integrations share: find the DDP model, start a doctor (a `ShardedDoctor` for a model sharded
with FSDP2), publish the report, apply fail_on."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core import CHECK_ENV_VAR
from ddp_doctor.core.codes import SEVERITIES
from ddp_doctor.core.errors import DoctorError, InvalidArgumentError
from ddp_doctor.doctor import Doctor, ShardedDoctor
from ddp_doctor.observation.wrapstate import WRAP_STATE_ATTR
from ddp_doctor.report import Report

__all__ = [
    "FAIL_ON",
    "FindingsError",
    "check_fail_on",
    "check_steps",
    "find_ddp",
    "observed_by_check",
    "publish",
    "raise_if_failing",
    "start_doctor",
    "start_sharded_doctor",
    "under_check",
    "unwrap_ddp",
]

FAIL_ON = ("error", "warning", "never")
"""The lowest severity that makes a callback raise `FindingsError`, as `ddp-doctor check --fail-on` takes it."""

JSON_NAME = "ddp_doctor.json"


class FindingsError(DoctorError):
    """The doctor found problems at or above `fail_on`. Raised on every rank, after the report was written.

    Attributes:
        report: the `Report` (identical on every rank).
        findings: the findings at or above `fail_on`.
        code: the code of the first of them, e.g. ``"unfrozen-after-wrap"``.
    """

    def __init__(self, message: str, *, report: Report, findings: list[Any]) -> None:
        super().__init__(message)
        self.report = report
        self.findings = findings
        self.code = findings[0].code if findings else ""


def check_fail_on(fail_on: str) -> str:
    if fail_on not in FAIL_ON:
        raise InvalidArgumentError(f"fail_on must be one of {', '.join(map(repr, FAIL_ON))}, got {fail_on!r}.")
    return fail_on


def check_steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(f"steps must be a positive int (optimizer steps to observe), got {steps!r}.")
    return steps


def unwrap_ddp(model: Any) -> DistributedDataParallel | None:
    """The `DistributedDataParallel` that `model` is, or that `torch.compile` wrapped (`_orig_mod`); else None."""
    for _ in range(4):
        if isinstance(model, DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return None


def find_ddp(module: torch.nn.Module) -> DistributedDataParallel | None:
    """The live `DistributedDataParallel` that wraps `module`, or None.

    Callbacks are handed the inner model (HF's `on_train_begin` gets `Trainer.model`, never `model_wrapped`), and
    nothing they receive points to the wrapper. The wrapper points to the model, so look it up from that side; a
    single scan of the tracked objects, once per training run.
    """
    if isinstance(module, DistributedDataParallel):
        return module
    # type(), not isinstance(): isinstance may read `__class__` through a proxy's __getattr__ (which can warn).
    found = [
        o
        for o in gc.get_objects()
        if issubclass(type(o), DistributedDataParallel)
        and (o.module is module or getattr(o.module, "_orig_mod", None) is module)
    ]
    return found[-1] if found else None


def observed_by_check(ddp: DistributedDataParallel) -> bool:
    """True when `ddp-doctor check` built this model (its launcher observes it already, and stops the run)."""
    state = getattr(ddp, WRAP_STATE_ATTR, None)
    return isinstance(state, dict) and "trainable" in state


def start_doctor(
    ddp: DistributedDataParallel,
    *,
    framework: str,
    steps: int | None,
    optimizer: torch.optim.Optimizer | str | None = "auto",
) -> Doctor:
    """`observe(ddp, optimizer, steps=steps)`, started, with the report phrased for `framework`."""
    doctor = Doctor(ddp, optimizer, steps=steps)
    doctor.info.framework = framework
    doctor.start()
    return doctor


def under_check() -> bool:
    """True in a rank that `ddp-doctor check` started: its launcher follows every model of the script already (a
    sharded one carries no mark of it, unlike a DDP model: `observed_by_check`)."""
    return CHECK_ENV_VAR in os.environ


def start_sharded_doctor(model: torch.nn.Module, *, framework: str, steps: int | None) -> ShardedDoctor:
    """`observe(model, "auto", steps=steps)` for a model with FSDP2 modules in it, started: it follows the first
    optimizer that steps, with the report phrased for `framework`."""
    doctor = ShardedDoctor(model, "auto", steps=steps, framework=framework)
    doctor.start()
    return doctor


def publish(report: Report, *, logger: logging.Logger, json_path: str | Path | None, is_main: bool) -> Path | None:
    """Log the report and write its JSON on the main process; returns the JSON path written, if any.

    The report goes to the log at WARNING when it has findings (so the default logging setup shows it) and at INFO
    when it is clean.
    """
    if not is_main:
        return None
    level = logging.WARNING if report.findings else logging.INFO
    logger.log(level, "ddp-doctor report after %d observed steps:\n%s", report.steps_observed, report)
    if json_path is None:
        return None
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(report.to_json())
    tmp.replace(path)
    return path


def raise_if_failing(report: Report, fail_on: str, *, where: str) -> None:
    """Raise `FindingsError` when the report has a finding at or above `fail_on` (the same on every rank)."""
    if fail_on == "never":
        return
    levels = SEVERITIES[: SEVERITIES.index(fail_on) + 1]
    bad = [f for f in report.findings if f.severity in levels]
    if bad:
        codes = ", ".join(sorted({f.code for f in bad}))
        raise FindingsError(
            f"ddp-doctor found {len(bad)} problem(s) at or above fail_on={fail_on!r}: {codes}. The report is in "
            f"{where}; apply its recommendation, or pass fail_on='never' to only report.",
            report=report,
            findings=bad,
        )
