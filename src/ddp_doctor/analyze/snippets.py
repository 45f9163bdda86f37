"""Copy-pasteable code for a recommendation, and fixes phrased in each framework's own words.

Pure: the frameworks are never imported here, and nothing is read from the process. What depends on the installed
versions (which `TrainingArguments` fields exist, which Lightning package) comes in as a `Flavor`, recorded where
the model was built (`wrapstate.current_flavor`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddp_doctor.core.findings import Recommendation
from ddp_doctor.core.records import Flavor

__all__ = ["TRAINING_ARGUMENTS_FIELDS", "flags_fix", "freeze_point", "render_snippets", "sync_batchnorm", "with_code"]

TRAINING_ARGUMENTS_FIELDS = {
    "find_unused_parameters": "ddp_find_unused_parameters",
    "static_graph": "ddp_static_graph",
    "bucket_cap_mb": "ddp_bucket_cap_mb",
    "broadcast_buffers": "ddp_broadcast_buffers",
}
"""DDP constructor argument -> the `TrainingArguments` field the HF Trainer forwards to it."""

_ANY = Flavor()


def _transformers_version(flavor: Flavor) -> str:
    return flavor.transformers_version or "the installed version"


def _split_hf(flags: dict[str, Any], flavor: Flavor) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TrainingArguments fields that exist on this version, DDP arguments that have no field)."""
    fields = flavor.training_arguments_fields
    mapped: dict[str, Any] = {}
    missing: dict[str, Any] = {}
    for key, value in flags.items():
        name = TRAINING_ARGUMENTS_FIELDS.get(key)
        if name is not None and (fields is None or name in fields):
            mapped[name] = value
        else:
            missing[key] = value
    return mapped, missing


def _lightning_strategy(flags: dict[str, Any]) -> str:
    # Lightning registers strategy strings for the find_unused_parameters flag alone.
    if set(flags) <= {"find_unused_parameters", "static_graph"} and not flags.get("static_graph"):
        if flags.get("find_unused_parameters"):
            return '"ddp_find_unused_parameters_true"'
        return '"ddp"'
    return "DDPStrategy(" + ", ".join(f"{k}={v!r}" for k, v in flags.items()) + ")"


def flags_fix(framework: str, flags: dict[str, Any], flavor: Flavor = _ANY) -> str:
    """How to build DDP with `flags`, as the user of `framework` at `flavor`'s versions sets them (a clause, no
    final period).

    Example:
        >>> flags_fix("transformers", {"find_unused_parameters": False})
        'set TrainingArguments(ddp_find_unused_parameters=False)'
    """
    kwargs = ", ".join(f"{k}={v!r}" for k, v in flags.items())
    if framework == "transformers":
        mapped, missing = _split_hf(flags, flavor)
        parts = []
        if mapped:
            parts.append("set TrainingArguments(" + ", ".join(f"{k}={v!r}" for k, v in mapped.items()) + ")")
        if missing:
            names = ", ".join(f"{k}={v!r}" for k, v in missing.items())
            parts.append(
                f"set {names} on the DDP kwargs the Trainer builds (TrainingArguments on transformers "
                f"{_transformers_version(flavor)} has no field for {', '.join(missing)}: subclass Trainer, and in "
                "_wrap_model, after super()._wrap_model(...), set it on self.accelerator.ddp_handler)"
            )
        return " and ".join(parts)
    if framework == "accelerate":
        return f"pass Accelerator(kwargs_handlers=[DistributedDataParallelKwargs({kwargs})])"
    if framework == "lightning":
        return f"use Trainer(strategy={_lightning_strategy(flags)})"
    return "build DDP with " + " and ".join(f"{k}={v!r}" for k, v in flags.items())


def sync_batchnorm(device_type: str, when: str) -> str | None:
    """The fix that converts BatchNorm to SyncBatchNorm `when` ("before wrapping the model in DDP"); None on CPU,
    where SyncBatchNorm does not run (DDP refuses it on a CPU module, "SyncBatchNorm layers only work with GPU
    modules", and its forward needs a GPU): no report advises a fix that cannot run."""
    if device_type == "cpu":
        return None
    return f"convert BatchNorm with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) {when}"


def freeze_point(framework: str) -> str:
    """Where, in `framework`'s flow, requires_grad must be final: before the DDP model is built."""
    return {
        "transformers": "before trainer.train() (the Trainer builds DDP there)",
        "accelerate": "before accelerator.prepare(model)",
        "lightning": "before trainer.fit() builds DDP (in the LightningModule's __init__, or in "
        "BaseFinetuning.freeze_before_training)",
    }.get(framework, "before wrapping the model in DDP")


def _freeze_lines(names: list[str], target: str, when: str) -> list[str]:
    if not names:
        return []
    listed = ",\n    ".join(repr(n) for n in names)
    return [
        f"# {when[0].upper()}{when[1:]}: these parameters never reach the loss, so DDP should not reduce them.",
        f"for name in [\n    {listed},\n]:",
        f"    {target}.get_parameter(name).requires_grad_(False)",
        "",
    ]


def _kwargs(rec: Recommendation) -> list[tuple[str, bool]]:
    out = [("find_unused_parameters", rec.find_unused_parameters), ("static_graph", rec.static_graph)]
    if rec.gradient_as_bucket_view:
        out.append(("gradient_as_bucket_view", True))
    return out


def _transformers_code(rec: Recommendation, flavor: Flavor) -> str:
    flags = dict(_kwargs(rec))
    if not rec.static_graph:
        flags.pop("static_graph")  # None, Accelerate's default False, is what the Trainer passes unless told
    mapped, missing = _split_hf(flags, flavor)
    lines = _freeze_lines(rec.freeze_before_wrap, "model", "before trainer.train()")
    lines += [
        "from transformers import TrainingArguments",
        "args = TrainingArguments(..., " + ", ".join(f"{k}={v}" for k, v in mapped.items()) + ")",
    ]
    if missing:
        # The Trainer builds DDP through Accelerate from `accelerator.ddp_handler`, filled in by _wrap_model
        # (transformers 4.x) or by the Accelerator's kwargs_handlers (5.x); _wrap_model runs before prepare() in both.
        sets = [f"        handler.{k} = {v}" for k, v in missing.items()]
        lines += [
            "",
            (
                f"# TrainingArguments on transformers {_transformers_version(flavor)} has no field for "
                f"{', '.join(missing)}: set it on the DDP kwargs the Trainer hands to Accelerate."
            ),
            "from accelerate.utils import DistributedDataParallelKwargs",
            "from transformers import Trainer",
            "",
            "class DoctorTrainer(Trainer):",
            "    def _wrap_model(self, model, training=True, dataloader=None):",
            "        model = super()._wrap_model(model, training, dataloader)",
            "        handler = self.accelerator.ddp_handler or DistributedDataParallelKwargs()",
            *sets,
            "        self.accelerator.ddp_handler = handler",
            "        return model",
        ]
    return "\n".join(lines)


def render_snippets(rec: Recommendation, ddp_config: dict[str, Any], flavor: Flavor = _ANY) -> dict[str, str]:
    """Return `{"torch": ..., "transformers": ..., "accelerate": ..., "lightning": ...}` code strings for `rec`,
    phrased for the versions in `flavor`; empty when `rec` knows no flags."""
    if not rec.flags_known:
        return {}
    args = ", ".join(f"{k}={v}" for k, v in _kwargs(rec))
    device = "device_ids=[local_rank], " if ddp_config.get("device_ids") else ""
    torch_code = "\n".join(
        _freeze_lines(rec.freeze_before_wrap, "model", "before wrapping")
        + [
            "from torch.nn.parallel import DistributedDataParallel",
            f"model = DistributedDataParallel(model, {device}{args})",
        ]
    )

    accelerate_code = "\n".join(
        _freeze_lines(rec.freeze_before_wrap, "model", "before accelerator.prepare(model)")
        + [
            "from accelerate import Accelerator, DistributedDataParallelKwargs",
            f"accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs({args})])",
            "# or from this report: ddp_doctor.integrations.accelerate.kwargs_handler(report)",
        ]
    )

    package = flavor.lightning_package
    strategy = _lightning_strategy(dict(_kwargs(rec)))
    lightning_code = "\n".join(
        _freeze_lines(rec.freeze_before_wrap, "model", "before trainer.fit(model)")
        + [
            f"from {package} import Trainer",
            f"from {package}.strategies import DDPStrategy",
            f"trainer = Trainer(strategy=DDPStrategy({args}))"
            + (f"  # or strategy={strategy}" if not strategy.startswith("DDPStrategy") else ""),
        ]
    )
    return {
        "torch": torch_code,
        "transformers": _transformers_code(rec, flavor),
        "accelerate": accelerate_code,
        "lightning": lightning_code,
    }


def with_code(rec: Recommendation, ddp_config: dict[str, Any], flavor: Flavor = _ANY) -> Recommendation:
    """`rec` with its code (`render`) for the script's `ddp_config`, phrased for `flavor`: a new recommendation, so
    no one fills in the code of one already handed out. The analysis calls it before it returns a diagnosis; bench
    for its verdict."""
    return dataclasses.replace(rec, render=render_snippets(rec, ddp_config, flavor))
