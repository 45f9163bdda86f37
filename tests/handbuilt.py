"""The small model the exchange's tests build records for by hand: five parameters (the last ignored by DDP) and a
BatchNorm buffer, so every round of the exchange has something to carry."""

from __future__ import annotations

from ddp_doctor.core.records import ModelInfo

NAMES = ["trunk.weight", "trunk.bias", "head_a.weight", "head_b.weight", "norm.weight"]
P = len(NAMES)


def model_info(**overrides) -> ModelInfo:
    """The model as DDP wrapped it, with `overrides` of any `ModelInfo` field."""
    base = {
        "param_names": NAMES,
        "param_shapes": [(4, 3), (4,), (2, 4), (2, 4), (4,)],
        "trainable_at_wrap": [True] * P,
        "ignored": [False] * (P - 1) + [True],
        "buffer_names": ["norm.running_mean"],
        "buffer_shapes": [(4,)],
        "ddp_config": {"find_unused_parameters": True, "static_graph": False, "broadcast_buffers": True},
        "batchnorm": ["norm"],
    }
    base.update(overrides)
    return ModelInfo(**base)
