"""Copy-pasteable code for a recommendation, and fixes phrased in each framework's own words.

The frameworks are never imported here (the core must not depend on them). Where the installed version matters
(which `TrainingArguments` fields exist), it is read from the modules the user's process has already imported,
which is the case whenever that framework built the DDP model.
"""

from __future__ import annotations

import sys
from typing import Any

from ddp_doctor.report.model import Recommendation

__all__ = ["TRAINING_ARGUMENTS_FIELDS", "flags_fix", "freeze_point", "lightning_package", "render_snippets",
           "training_arguments_fields"]

TRAINING_ARGUMENTS_FIELDS = {
    "find_unused_parameters": "ddp_find_unused_parameters",
    "static_graph": "ddp_static_graph",
    "bucket_cap_mb": "ddp_bucket_cap_mb",
    "broadcast_buffers": "ddp_broadcast_buffers",
}
"""DDP constructor argument -> the `TrainingArguments` field the HF Trainer forwards to it."""


def training_arguments_fields() -> set[str] | None:
    """The field names of the imported `transformers.TrainingArguments`; None when transformers is not imported.

    `ddp_static_graph` only exists on recent versions (4.x has none), so a fix must not promise a field the user's
    version lacks.
    """
    module = sys.modules.get("transformers.training_args")
    cls = getattr(module, "TrainingArguments", None)
    fields = getattr(cls, "__dataclass_fields__", None)
    return set(fields) if fields is not None else None


def _transformers_version() -> str:
    return str(getattr(sys.modules.get("transformers"), "__version__", "")) or "the installed version"


def lightning_package() -> str:
    """`lightning.pytorch`, or `pytorch_lightning` when only that one is imported."""
    if "pytorch_lightning" in sys.modules and "lightning" not in sys.modules:
        return "pytorch_lightning"
    return "lightning.pytorch"


def _split_hf(flags: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TrainingArguments fields that exist on this version, DDP arguments that have no field)."""
    fields = training_arguments_fields()
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


def flags_fix(framework: str, flags: dict[str, Any]) -> str:
    """How to build DDP with `flags`, as the user of `framework` sets them (a clause, no final period).

    Example:
        >>> flags_fix("transformers", {"find_unused_parameters": False})
        'set TrainingArguments(ddp_find_unused_parameters=False)'
    """
    kwargs = ", ".join(f"{k}={v!r}" for k, v in flags.items())
    if framework == "transformers":
        mapped, missing = _split_hf(flags)
        parts = []
        if mapped:
            parts.append("set TrainingArguments(" + ", ".join(f"{k}={v!r}" for k, v in mapped.items()) + ")")
        if missing:
            names = ", ".join(f"{k}={v!r}" for k, v in missing.items())
            parts.append(f"set {names} on the DDP kwargs the Trainer builds (TrainingArguments on transformers "
                         f"{_transformers_version()} has no field for {', '.join(missing)}: subclass Trainer, and in "
                         "_wrap_model, after super()._wrap_model(...), set it on self.accelerator.ddp_handler)")
        return " and ".join(parts)
    if framework == "accelerate":
        return f"pass Accelerator(kwargs_handlers=[DistributedDataParallelKwargs({kwargs})])"
    if framework == "lightning":
        return f"use Trainer(strategy={_lightning_strategy(flags)})"
    return "build DDP with " + " and ".join(f"{k}={v!r}" for k, v in flags.items())


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


def _transformers_code(rec: Recommendation) -> str:
    flags = dict(_kwargs(rec))
    if not rec.static_graph:
        flags.pop("static_graph")  # None, Accelerate's default False, is what the Trainer passes unless told
    mapped, missing = _split_hf(flags)
    lines = _freeze_lines(rec.freeze_before_wrap, "model", "before trainer.train()")
    lines += ["from transformers import TrainingArguments",
              "args = TrainingArguments(..., " + ", ".join(f"{k}={v}" for k, v in mapped.items()) + ")"]
    if missing:
        # The Trainer builds DDP through Accelerate from `accelerator.ddp_handler`, filled in by _wrap_model
        # (transformers 4.x) or by the Accelerator's kwargs_handlers (5.x); _wrap_model runs before prepare() in both.
        sets = [f"        handler.{k} = {v}" for k, v in missing.items()]
        lines += [
            "",
            (f"# TrainingArguments on transformers {_transformers_version()} has no field for "
             f"{', '.join(missing)}: set it on the DDP kwargs the Trainer hands to Accelerate."),
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


def render_snippets(rec: Recommendation, ddp_config: dict[str, Any]) -> dict[str, str]:
    """Return `{"torch": ..., "transformers": ..., "accelerate": ..., "lightning": ...}` code strings."""
    args = ", ".join(f"{k}={v}" for k, v in _kwargs(rec))
    device = "device_ids=[local_rank], " if ddp_config.get("device_ids") else ""
    torch_code = "\n".join(_freeze_lines(rec.freeze_before_wrap, "model", "before wrapping") + [
        "from torch.nn.parallel import DistributedDataParallel",
        f"model = DistributedDataParallel(model, {device}{args})",
    ])

    accelerate_code = "\n".join(_freeze_lines(rec.freeze_before_wrap, "model", "before accelerator.prepare(model)") + [
        "from accelerate import Accelerator, DistributedDataParallelKwargs",
        f"accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs({args})])",
        "# or from this report: ddp_doctor.integrations.accelerate.kwargs_handler(report)",
    ])

    package = lightning_package()
    strategy = _lightning_strategy(dict(_kwargs(rec)))
    lightning_code = "\n".join(_freeze_lines(rec.freeze_before_wrap, "model", "before trainer.fit(model)") + [
        f"from {package} import Trainer",
        f"from {package}.strategies import DDPStrategy",
        f"trainer = Trainer(strategy=DDPStrategy({args}))"
        + (f"  # or strategy={strategy}" if not strategy.startswith("DDPStrategy") else ""),
    ])
    return {"torch": torch_code, "transformers": _transformers_code(rec), "accelerate": accelerate_code,
            "lightning": lightning_code}
