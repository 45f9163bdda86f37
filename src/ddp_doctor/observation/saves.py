"""Which files a rank writes with `torch.save` while it is observed.

Every rank saving the same checkpoint file (no rank guard) makes them race on one path: a torn or interleaved file,
or, on a shared file system, a checkpoint whose content depends on which rank wrote last. `torch.save` is wrapped
once, process-wide (the launcher installs it before the script runs, so `from torch import save` in the script
gets the wrapper too); each call that names a file is passed to whoever listens (the observing doctors). Local facts
only: the path, the user's line, and whether what was saved is the DDP wrapper's state dict (keys `module.*`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddp_doctor.core.frames import user_site
from ddp_doctor.observation.hooks import ListenerList

__all__ = ["describe", "install", "listen"]

Listener = Callable[[dict[str, Any]], None]
_listeners: ListenerList[Listener] = ListenerList()
_installed = False
_PREFIX = "module."


def _path(f: Any) -> str | None:
    """The absolute path `torch.save` writes to, or None for a buffer (BytesIO) or an unnamed stream."""
    if isinstance(f, (str, os.PathLike)):
        return os.path.abspath(os.fspath(f))
    name = getattr(f, "name", None)
    return os.path.abspath(name) if isinstance(name, str) else None


def _module_prefixed(obj: Any) -> bool:
    """A state dict of the DDP wrapper (every key `module.*`), saved as is or one level down (`{"model": ...}`)."""

    def prefixed(d: Mapping[Any, Any]) -> bool:
        return bool(d) and all(isinstance(k, str) and k.startswith(_PREFIX) for k in d)

    if not isinstance(obj, Mapping):
        return False
    return prefixed(obj) or any(isinstance(v, Mapping) and prefixed(v) for v in obj.values())


def describe(obj: Any, f: Any) -> dict[str, Any] | None:
    """What a `torch.save(obj, f)` call writes: `path` (absolute), `shown` (relative to the working folder when
    inside it), `site` and `module_prefix`; None when `f` names no file."""
    path = _path(f)
    if path is None:
        return None
    here = os.getcwd()
    shown = os.path.relpath(path, here) if path.startswith(here + os.sep) else path
    return {"path": path, "shown": shown, "site": user_site(), "module_prefix": _module_prefixed(obj)}


def _install() -> None:
    global _installed
    original = torch.save

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if _listeners:
            info = describe(obj, f)
            if info is not None:
                for listener in _listeners:
                    listener(info)
        return original(obj, f, *args, **kwargs)

    torch.save = save
    _installed = True


def install() -> None:
    """Wrap `torch.save` now (the launcher does it before the script runs)."""
    if not _installed:
        _install()


def listen(listener: Listener) -> Callable[[], None]:
    """Pass each `torch.save` to a named file to `listener`; returns the function that stops it."""
    if not _installed:
        _install()
    return _listeners.add(listener)
