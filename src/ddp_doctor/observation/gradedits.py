"""Probes of what decides the gradients an optimizer step uses, besides DDP's all-reduce: calls of
`torch.nn.utils.clip_grad_norm_` and `clip_grad_value_` (the user's line, passed to whoever listens), and where the
script last turned a DDP model's gradient sync off (`with ddp.no_sync():`, or nanoGPT's
`ddp.require_backward_grad_sync = False`), remembered per DDP model.

Both are wrapped once per process (the launcher installs them before the script runs, so
`from torch.nn.utils import clip_grad_norm_` in the script gets the wrapper too). Local facts only.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.frames import user_site, user_site_of
from ddp_doctor.observation.hooks import ListenerList

__all__ = ["CLIPPERS", "install", "listen", "sync_off_site"]

CLIPPERS = {"clip_grad_norm_": "max_norm", "clip_grad_value_": "clip_value"}
"""The clipping functions probed, and the argument each is quoted with."""

Listener = Callable[[str], None]
_listeners: ListenerList[Listener] = ListenerList()
_state = {"inside": False, "installed": False}
_sync_off: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_CONTEXTLIB = contextlib.__file__


def _quoted(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """`clip_grad_norm_(max_norm=0.5)`: the call, with its threshold when it is a plain number."""
    key = CLIPPERS[name]
    value = kwargs.get(key, args[1] if len(args) > 1 else None)
    return f"{name}({key}={value})" if isinstance(value, (int, float)) else f"{name}()"


def _wrap_clipper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clipper(*args: Any, **kwargs: Any) -> Any:
        # The deprecated `clip_grad_norm` calls `clip_grad_norm_`: one call of the user's, reported once.
        if not _listeners or _state["inside"]:
            return original(*args, **kwargs)
        text = f"{_quoted(name, args, kwargs)} at {user_site() or 'an unknown place'}"
        for listener in _listeners:
            listener(text)
        _state["inside"] = True
        try:
            return original(*args, **kwargs)
        finally:
            _state["inside"] = False

    clipper.__ddp_doctor_wrapped__ = original  # type: ignore[attr-defined]
    return clipper


def _outside_contextlib(frame: FrameType | None) -> FrameType | None:
    while frame is not None and frame.f_code.co_filename == _CONTEXTLIB:
        frame = frame.f_back
    return frame


def _install_sync_flag() -> None:
    """Wrap `DistributedDataParallel.__setattr__` to remember where `require_backward_grad_sync` was set to False:
    `no_sync()` sets it itself (the user's line is the `with` statement), nanoGPT's loop assigns it."""
    original = DistributedDataParallel.__setattr__

    def __setattr__(self: DistributedDataParallel, name: str, value: Any) -> None:
        if name == "require_backward_grad_sync" and not value:
            caller = sys._getframe(1)
            if caller.f_code.co_name == "no_sync":  # DDP's context manager, entered from the user's `with`
                site = user_site_of(_outside_contextlib(caller.f_back), None, frameworks=False)
                _sync_off[self] = f"no_sync() at {site or 'an unknown place'}"
            else:
                site = user_site_of(caller, None, frameworks=False)
                _sync_off[self] = f"require_backward_grad_sync=False at {site or 'an unknown place'}"
        original(self, name, value)

    DistributedDataParallel.__setattr__ = __setattr__  # type: ignore[method-assign]


def install() -> None:
    """Wrap the clipping functions and DDP's attribute writes now (the launcher does it before the script runs)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    for name in CLIPPERS:
        original = getattr(torch.nn.utils.clip_grad, name, None)
        if original is None:
            continue
        wrapped = _wrap_clipper(name, original)
        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)
    _install_sync_flag()


def listen(listener: Listener) -> Callable[[], None]:
    """Pass each clipping call (`clip_grad_norm_(max_norm=0.5) at file:line`) to `listener`; returns the function
    that stops it."""
    install()
    return _listeners.add(listener)


def sync_off_site(ddp: torch.nn.Module) -> str | None:
    """Where the script last set `ddp`'s `require_backward_grad_sync` to False (None: not seen)."""
    return _sync_off.get(ddp)
