"""Where the script calls reentrant activation checkpointing, and whether any input of the call requires grad.

`checkpoint(block, x, use_reentrant=True)` with no input that requires grad gives the block's parameters no
gradient at all (PyTorch only warns). The doctor has to know the call site to say so, and the call is invisible in
the autograd graph (there is no graph), so `CheckpointFunction.forward` is wrapped once, process-wide, and passes
each call to whoever listens. With no listener the wrapper only adds one list check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.core.frames import user_site
from ddp_doctor.observation.hooks import ListenerList

__all__ = ["listen"]

Listener = Callable[[str | None, bool], None]
"""Called with (the user's `file:line`, whether any tensor input requires grad)."""

_listeners: ListenerList[Listener] = ListenerList()
_installed = False


def _install() -> None:
    global _installed
    from torch.utils.checkpoint import CheckpointFunction

    original = CheckpointFunction.forward

    def forward(ctx: Any, run_function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        if _listeners:
            needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            site = user_site()
            for listener in _listeners:
                listener(site, needs_grad)
        return original(ctx, run_function, preserve_rng_state, *args)

    CheckpointFunction.forward = staticmethod(forward)
    _installed = True


def listen(listener: Listener) -> Callable[[], None]:
    """Start passing reentrant checkpoint calls to `listener`; returns the function that stops it."""
    if not _installed:
        _install()
    return _listeners.add(listener)
