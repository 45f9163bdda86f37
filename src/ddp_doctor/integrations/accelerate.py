"""ddp-doctor for Hugging Face Accelerate: observe an `accelerator.prepare(...)` model; turn a report into flags.

```python
from ddp_doctor.integrations.accelerate import kwargs_handler, observe

model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
with observe(model, optimizer, steps=8) as doctor:
    for batch in loader: ...                      # the usual loop: accelerator.backward(loss), optimizer.step()
report = doctor.report()                          # collective: every process calls it
accelerator.print(report)

# next run: the recommended flags, as Accelerate takes them
accelerator = Accelerator(kwargs_handlers=[kwargs_handler(report)])
```

`accelerator.prepare` wraps the model in `DistributedDataParallel` when the script runs in several processes,
with flags from `DistributedDataParallelKwargs` (Accelerate's default: find_unused_parameters=False).

Scripts meant for `accelerate launch` run under `ddp-doctor check` unmodified: `accelerate launch` starts
processes the way torchrun does, and `Accelerator()` reads the same environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so `ddp-doctor check --nproc-per-node 2 train.py` stands in for
`accelerate launch --num_processes 2 train.py` (add `--cpu` to Accelerate's own flags where the script expects it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:
    from accelerate.utils import DistributedDataParallelKwargs
except ImportError as exc:  # pragma: no cover  (the extra is not installed)
    raise ImportError(
        "ddp_doctor.integrations.accelerate needs the accelerate package: pip install 'ddp-doctor[accelerate]'"
    ) from exc

from ddp_doctor.core.compat import is_sharded
from ddp_doctor.core.errors import InvalidArgumentError, NotDDPModelError
from ddp_doctor.core.findings import Recommendation
from ddp_doctor.doctor import Doctor, ShardedDoctor
from ddp_doctor.integrations._common import unwrap_ddp
from ddp_doctor.report import Report
from ddp_doctor.report.data import recommendation_words

__all__ = ["kwargs_handler", "observe"]

logger = logging.getLogger(__name__)


def observe(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | str | None = "auto", *, steps: int | None = None
) -> Doctor | ShardedDoctor:
    """`ddp_doctor.observe` for what `accelerator.prepare` returned; the report speaks Accelerate.

    Args:
        model: the prepared model: a `DistributedDataParallel`, or a `torch.compile` wrapper around one; or a
            model sharded with FSDP2 (Accelerate's FSDP2 plugin, on GPUs, or `fully_shard` called by the script).
        optimizer: the prepared optimizer (an `AcceleratedOptimizer` is unwrapped to the torch optimizer it
            steps), a torch optimizer, `"auto"` (default: the first optimizer whose step() updates the model), or
            None (then a step is one synchronized backward).
        steps: stop observing after this many steps; None observes until the `with` block ends.

    Returns:
        A `Doctor` (a `ShardedDoctor` for a sharded model): use it as a context manager, then call `report()` on
        every process.

    Raises:
        NotDDPModelError: `model` is neither DDP-wrapped nor sharded with FSDP2 (one process, or a strategy such as
            FSDP1 or DeepSpeed); the message names Accelerate's distributed type.
        InvalidArgumentError: `optimizer` or `steps` has an unusable value.

    Example:
        >>> with observe(model, optimizer, steps=8) as doctor:
        ...     train_some_steps()
        >>> accelerator.print(doctor.report())
    """
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        # AcceleratedOptimizer: its step() calls the torch optimizer's (skipped on accumulation micro-steps), and
        # that one carries the step hooks.
        optimizer = inner
    sharded = getattr(model, "_orig_mod", model)  # a torch.compile wrapper around the prepared model
    if is_sharded(sharded):  # Accelerate's FSDP2 plugin, or a model the script sharded itself
        return ShardedDoctor(sharded, optimizer, steps=steps, framework="accelerate")
    ddp = unwrap_ddp(model)
    if ddp is None:
        from accelerate.state import PartialState

        state = PartialState()
        raise NotDDPModelError(
            "observe() needs the model that accelerator.prepare() wrapped in DistributedDataParallel or sharded "
            f"with FSDP2 (its FSDP2 plugin, on GPUs), got "
            f"{type(model).__module__}.{type(model).__qualname__} (Accelerate's distributed_type is "
            f"{state.distributed_type}, {state.num_processes} process(es)). Accelerate wraps in DDP only with "
            "several processes: run the script with `accelerate launch --num_processes 2`, torchrun, or "
            "`ddp-doctor check --nproc-per-node 2`."
        )
    doctor = Doctor(ddp, optimizer, steps=steps)
    doctor.info.framework = "accelerate"
    return doctor


def kwargs_handler(report: Report | Recommendation | dict[str, Any], **overrides: Any) -> DistributedDataParallelKwargs:
    """The report's recommended DDP flags as Accelerate's `DistributedDataParallelKwargs`.

    Pass it as `Accelerator(kwargs_handlers=[kwargs_handler(report)])`. The recommendation may also list
    parameters to freeze before wrapping (`report.recommendation.freeze_before_wrap`): flags cannot do that, so set
    `requires_grad_(False)` on them before `accelerator.prepare(model)`.

    Args:
        report: a `Report`, its `Recommendation`, or the report's JSON as a dict (`json.load` of `--json` output).
        **overrides: other `DistributedDataParallelKwargs` fields to set (`bucket_cap_mb=...`, ...).

    Returns:
        A `DistributedDataParallelKwargs` with find_unused_parameters, static_graph and gradient_as_bucket_view
        set as recommended.

    Raises:
        InvalidArgumentError: `report` is none of those, it recommends no flags (they are null: the run failed
            before anything supported flags), or an override is not a field of `DistributedDataParallelKwargs`.

    Example:
        >>> accelerator = Accelerator(kwargs_handlers=[kwargs_handler(report)])
    """
    if isinstance(report, dict):
        if "recommendation" not in report:
            raise InvalidArgumentError(
                f"kwargs_handler() got a dict without a 'recommendation' key (keys: {sorted(report)[:10]}); pass "
                "a ddp-doctor report, e.g. json.load(open('report.json'))."
            )
        report = Report.from_dict(report)
    rec = report.recommendation if isinstance(report, Report) else report
    if not isinstance(rec, Recommendation):
        raise InvalidArgumentError(
            f"kwargs_handler() needs a ddp_doctor Report, Recommendation or report dict, got {type(report).__name__}."
        )
    if not rec.flags_known:
        raise InvalidArgumentError(
            f"kwargs_handler(): the report recommends no DDP flags, so there is nothing to apply: {recommendation_words(rec)}"
        )
    fields = set(DistributedDataParallelKwargs.__dataclass_fields__)
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise InvalidArgumentError(
            f"kwargs_handler() got {unknown}, which DistributedDataParallelKwargs does not have. It has: "
            f"{', '.join(sorted(fields))}."
        )
    if rec.freeze_before_wrap:
        logger.warning(
            "ddp-doctor: the recommendation also freezes %d parameter(s) before wrapping, which DDP flags "
            "cannot do: set requires_grad_(False) on %s before accelerator.prepare(model).",
            len(rec.freeze_before_wrap),
            rec.freeze_before_wrap,
        )
    flags = {
        "find_unused_parameters": rec.find_unused_parameters,
        "static_graph": rec.static_graph,
        "gradient_as_bucket_view": rec.gradient_as_bucket_view,
    }
    return DistributedDataParallelKwargs(**{**flags, **overrides})
