"""The loss scale of AMP's GradScaler at each `scaler.step(optimizer)` (local facts only).

Ranks whose gradients are synchronized see the same infs and NaNs, so their scalers skip the same steps and keep the
same scale. A scale that differs across ranks means the ranks skip different optimizer steps, and the replicas
drift apart. `GradScaler.step` is wrapped once, process-wide; each call's scale is passed to whoever listens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.core.records import decode_scale, encode_scale
from ddp_doctor.observation.hooks import ListenerList

__all__ = ["decode", "encode", "listen", "scaled"]

Listener = Callable[[float], None]
_listeners: ListenerList[Listener] = ListenerList()
_installed = False
_scaled: list[Any] = [0, None]
"""How many `GradScaler.scale(outputs)` calls this process made since the probe was installed, and the last one's
scale tensor: a backward from a scaled loss carries that factor."""


def scaled() -> tuple[int, torch.Tensor | None]:
    """(the count of `GradScaler.scale` calls so far, the last one's scale tensor)."""
    return _scaled[0], _scaled[1]


encode = encode_scale
"""The scale as the record carries it (`ddp_doctor.core.records.encode_scale`)."""
decode = decode_scale


def _scaler_classes() -> list[type]:
    found = []
    for path in ("amp", "cuda.amp"):
        module: Any = torch
        for part in path.split("."):
            module = getattr(module, part, None)
        cls = getattr(module, "GradScaler", None)
        if isinstance(cls, type) and "step" in cls.__dict__:
            found.append(cls)
    return found


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    for cls in _scaler_classes():
        original = cls.step

        @functools.wraps(original)
        def step(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if _listeners and self.is_enabled() and getattr(self, "_scale", None) is not None:
                scale = float(self.get_scale())
                for listener in _listeners:
                    listener(scale)
            return __original(self, *args, **kwargs)

        cls.step = step
        original_scale = cls.__dict__.get("scale")
        if original_scale is None:
            continue

        @functools.wraps(original_scale)
        def scale(self: Any, outputs: Any, __original: Any = original_scale) -> Any:
            out = __original(self, outputs)
            if self.is_enabled() and getattr(self, "_scale", None) is not None:
                _scaled[0], _scaled[1] = _scaled[0] + 1, self._scale
            return out

        cls.scale = scale


def listen(listener: Listener) -> Callable[[], None]:
    """Pass the scale of each `GradScaler.step` call to `listener`; returns the function that stops it."""
    _install()
    return _listeners.add(listener)
