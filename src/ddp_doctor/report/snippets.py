"""Copy-pasteable code for a recommendation, in each framework's own words."""

from __future__ import annotations

from typing import Any

from ddp_doctor.report.model import Recommendation

__all__ = ["render_snippets"]


def _freeze_lines(names: list[str], target: str) -> list[str]:
    if not names:
        return []
    listed = ",\n    ".join(repr(n) for n in names)
    return [
        "# Before wrapping: these parameters never reach the loss, so DDP should not reduce them.",
        f"for name in [\n    {listed},\n]:",
        f"    {target}.get_parameter(name).requires_grad_(False)",
        "",
    ]


def _kwargs(rec: Recommendation, *, include_defaults: bool = True) -> list[tuple[str, bool]]:
    out = [("find_unused_parameters", rec.find_unused_parameters), ("static_graph", rec.static_graph)]
    if rec.gradient_as_bucket_view:
        out.append(("gradient_as_bucket_view", True))
    return out if include_defaults else [(k, v) for k, v in out if v]


def render_snippets(rec: Recommendation, ddp_config: dict[str, Any]) -> dict[str, str]:
    """Return `{"torch": ..., "transformers": ..., "accelerate": ..., "lightning": ...}` code strings."""
    args = ", ".join(f"{k}={v}" for k, v in _kwargs(rec))
    device = "device_ids=[local_rank], " if ddp_config.get("device_ids") else ""
    torch_code = "\n".join(_freeze_lines(rec.freeze_before_wrap, "model") + [
        "from torch.nn.parallel import DistributedDataParallel",
        f"model = DistributedDataParallel(model, {device}{args})",
    ])

    hf_fields = [f"ddp_find_unused_parameters={rec.find_unused_parameters}"]
    if rec.static_graph:
        hf_fields.append("ddp_static_graph=True")
    transformers_code = "\n".join(_freeze_lines(rec.freeze_before_wrap, "model") + [
        "from transformers import TrainingArguments",
        f"args = TrainingArguments(..., {', '.join(hf_fields)})",
    ])

    accelerate_code = "\n".join(_freeze_lines(rec.freeze_before_wrap, "model") + [
        "from accelerate import Accelerator, DistributedDataParallelKwargs",
        f"accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs({args})])",
    ])

    lightning_code = "\n".join(_freeze_lines(rec.freeze_before_wrap, "model") + [
        "from lightning.pytorch import Trainer",
        "from lightning.pytorch.strategies import DDPStrategy",
        f"trainer = Trainer(strategy=DDPStrategy({args}))",
    ])
    return {"torch": torch_code, "transformers": transformers_code, "accelerate": accelerate_code,
            "lightning": lightning_code}
