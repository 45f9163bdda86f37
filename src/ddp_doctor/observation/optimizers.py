"""The optimizer's settings at each step, and the LR schedulers that change them (local facts only).

`describe` turns an optimizer's param groups into a 31-bit digest and a line of text: every scalar hyperparameter
(lr, momentum, betas, weight decay, ...), the number of groups and each group's size, and a glimpse of its state
(how many tensors hold state, the first one's step count, where `load_state_dict` last loaded it). Ranks whose
digests differ at a step update their replicas differently even from identical gradients (a state loaded on rank 0
alone: Adam's moments and bias correction differ). The moments themselves are not read. `listen` wraps the `step()` of torch's
LR schedulers once per process and passes each outermost call (a `SequentialLR` calling its children counts once)
with its scheduler to whoever listens.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.core.frames import user_site
from ddp_doctor.observation.hooks import ListenerList

__all__ = ["LOADED_ATTR", "describe", "listen", "note_loads"]

Listener = Callable[[Any], None]
"""Called with the scheduler whose `step()` the script called."""
_listeners: ListenerList[Listener] = ListenerList()
_state = {"installed": False, "depth": 0}
_MAX_GROUPS = 8
"""Groups spelled out in the text (every group counts in the digest)."""
LOADED_ATTR = "_ddp_doctor_loaded_at"
"""Set on an optimizer by its `load_state_dict` post-hook (`note_loads`): the script's line that called it."""
_SHARDED_STATE = ("ZeroRedundancyOptimizer",)
"""Optimizers whose state is split across the ranks by design: their state is not described."""


def _scalar(value: Any) -> str | None:
    """A hyperparameter as text, or None for what is not one (the params, tensors of state, callables)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)):
        return repr(float(value)) if isinstance(value, float) and math.isfinite(value) else str(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        # A hyperparameter held on a GPU (a capturable or fused optimizer's tensor lr): reading it would synchronize
        # the device at every optimizer step, so it is named but not compared.
        return repr(float(value)) if value.device.type == "cpu" else f"<tensor on {value.device.type}>"
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
        return "(" + ", ".join(repr(float(v)) for v in value) + ")"
    if isinstance(value, str):
        return value
    return None


def describe(optimizer: torch.optim.Optimizer) -> tuple[int, str]:
    """(digest, text) of the optimizer's param groups: `group 0 (12 tensors) lr=0.05, momentum=0.9; group 1 ...`."""
    parts = []
    for i, group in enumerate(optimizer.param_groups):
        fields = []
        for key in sorted(group):
            if key == "params":
                continue
            text = _scalar(group[key])
            if text is not None:
                fields.append(f"{key}={text}")
        parts.append(f"group {i} ({len(group['params'])} tensors) " + ", ".join(fields))
    state = _state_text(optimizer)
    if state:
        parts.append(state)
    whole = "; ".join(parts)
    shown = "; ".join(parts[:_MAX_GROUPS]) + (
        f"; and {len(parts) - _MAX_GROUPS} more" if len(parts) > _MAX_GROUPS else ""
    )
    return (zlib.crc32(whole.encode()) & 0x7FFFFFFF) or 1, shown


def _state_text(optimizer: torch.optim.Optimizer) -> str:
    """`state (12 tensors) step=3.0, loaded=train.py:40`: how many tensors hold state, the step count of the first
    one in the groups' order (O(1) reads: the moments are not touched), where the state was last loaded."""
    if any(cls.__name__ in _SHARDED_STATE for cls in type(optimizer).__mro__):
        return ""
    held = optimizer.state
    fields = []
    first = next((held[p] for group in optimizer.param_groups for p in group["params"] if p in held), None)
    step = _scalar(first.get("step")) if isinstance(first, dict) and "step" in first else None
    if step is not None:
        fields.append(f"step={step}")
    loaded = getattr(optimizer, LOADED_ATTR, None)
    if loaded:
        fields.append(f"loaded={loaded}")
    return f"state ({len(held)} tensors) " + ", ".join(fields)


def note_loads(optimizer: torch.optim.Optimizer) -> None:
    """Remember on `optimizer` the script's line of each `load_state_dict` call (a post-hook, torch >= 2.2)."""
    register = getattr(optimizer, "register_load_state_dict_post_hook", None)
    if register is None:
        return

    def loaded(opt: torch.optim.Optimizer) -> None:
        setattr(opt, LOADED_ATTR, user_site())

    register(loaded)


def _scheduler_classes() -> list[type]:
    """LRScheduler and every scheduler class of torch that defines its own `step`."""
    module = torch.optim.lr_scheduler
    base = getattr(module, "LRScheduler", None) or getattr(module, "_LRScheduler", None)
    found = [base] if isinstance(base, type) else []
    for value in vars(module).values():
        if isinstance(value, type) and value not in found and "step" in value.__dict__:
            if (base is not None and issubclass(value, base)) or hasattr(value, "get_last_lr"):
                found.append(value)
    return found


def _install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    for cls in _scheduler_classes():
        original = cls.__dict__["step"]

        @functools.wraps(original)
        def step(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            # The first step() runs inside the scheduler's constructor (`_step_count` is still 0 then): that one is
            # not the script's call.
            outermost = _state["depth"] == 0 and getattr(self, "_step_count", 1) != 0
            _state["depth"] += 1
            try:
                return __original(self, *args, **kwargs)
            finally:
                _state["depth"] -= 1
                if outermost and _listeners:
                    for listener in list(_listeners):
                        listener(self)

        cls.step = step  # type: ignore[method-assign]


def listen(listener: Listener) -> Callable[[], None]:
    """Call `listener(scheduler)` at each outermost `step()` of a built LR scheduler; returns the remover."""
    _install()
    return _listeners.add(listener)
