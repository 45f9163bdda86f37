"""Which files a rank writes with `torch.save` while it is observed, and which it opens for writing.

Every rank saving the same checkpoint file (no rank guard) makes them race on one path: a torn or interleaved file,
or, on a shared file system, a checkpoint whose content depends on which rank wrote last. `torch.save` is wrapped
once, process-wide (the launcher installs it before the script runs, so `from torch import save` in the script
gets the wrapper too); each call that names a file is passed to whoever listens (the observing doctors). Local facts
only: the path, the user's line, whether what was saved is the DDP wrapper's state dict (keys `module.*`), and
whether it holds DTensors sharded across ranks (an FSDP2 model's `state_dict()`: each holds this rank's shard).

Whatever the script writes under the check stays behind, and a script that resumes from a snapshot it finds starts
its next real run from the check's few steps. `open()` is wrapped too (`listen_opens`): a call from the script's
own code (not a library's) with a mode that writes (`w`, `a`, `x`, `+`) is passed on with its path.
"""

from __future__ import annotations

import builtins
import functools
import os
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddp_doctor.core.compat import is_dtensor
from ddp_doctor.core.frames import is_user_frame, user_site
from ddp_doctor.observation.hooks import ListenerList

__all__ = ["describe", "install", "listen", "listen_opens"]

Listener = Callable[[dict[str, Any]], None]
_listeners: ListenerList[Listener] = ListenerList()
_open_listeners: ListenerList[Listener] = ListenerList()
_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
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


def _shards(obj: Any) -> dict[str, Any] | None:
    """The DTensors of `obj` (a state dict, as is or one level down) that hold a part of their tensor only: how many,
    and the first one's name with its local and global shapes; None when there is none."""
    if not isinstance(obj, Mapping):
        return None
    items = [(k, v) for k, v in obj.items() if not isinstance(v, Mapping)]
    items += [(f"{k}.{k2}", v2) for k, v in obj.items() if isinstance(v, Mapping) for k2, v2 in v.items()]
    partial = [(str(k), v) for k, v in items if is_dtensor(v) and tuple(v.to_local().shape) != tuple(v.shape)]
    if not partial:
        return None
    name, first = partial[0]
    return {
        "tensors": len(partial),
        "example": name,
        "local": list(first.to_local().shape),
        "global": list(first.shape),
    }


def _local_rank() -> int:
    """torchrun's LOCAL_RANK; -1 when not set or not a number (a save must never fail over it)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "-1"))
    except ValueError:
        return -1


def describe(obj: Any, f: Any) -> dict[str, Any] | None:
    """What a `torch.save(obj, f)` call writes: `path` (absolute), `shown` (relative to the working folder when
    inside it), `site`, `module_prefix`, `host` and `local_rank` (the machine that wrote it and the writer's rank on
    its node, torchrun's LOCAL_RANK: -1 when not set), and `shards` when it holds DTensor shards (`_shards`); None
    when `f` names no file."""
    path = _path(f)
    if path is None:
        return None
    here = os.getcwd()
    shown = os.path.relpath(path, here) if path.startswith(here + os.sep) else path
    out = {
        "path": path,
        "shown": shown,
        "site": user_site(),
        "module_prefix": _module_prefixed(obj),
        "existed": os.path.exists(path),
        "host": socket.gethostname(),  # one uname(2): a save or an open for writing, not a training step
        "local_rank": _local_rank(),
    }
    shards = _shards(obj)
    if shards is not None:
        out["shards"] = shards
    return out


def _writes(mode: Any) -> bool:
    return isinstance(mode, str) and any(c in mode for c in "wax+")


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
    original_open = builtins.open

    @functools.wraps(original_open)
    def open(file: Any, mode: Any = "r", *args: Any, **kwargs: Any) -> Any:  # noqa: A001  (builtins.open's name)
        if _open_listeners and _writes(mode) and isinstance(file, (str, os.PathLike)):
            caller = sys._getframe(1).f_code.co_filename
            if is_user_frame(caller) and not any(d in caller for d in _LIBRARIES):
                info = describe(None, file)
                if info is not None:
                    for listener in _open_listeners:
                        listener(info)
        return original_open(file, mode, *args, **kwargs)

    builtins.open = open
    _installed = True


def install() -> None:
    """Wrap `torch.save` and `open()` now (the launcher does it before the script runs)."""
    if not _installed:
        _install()


def listen(listener: Listener) -> Callable[[], None]:
    """Pass each `torch.save` to a named file to `listener`; returns the function that stops it."""
    if not _installed:
        _install()
    return _listeners.add(listener)


def listen_opens(listener: Listener) -> Callable[[], None]:
    """Pass each `open()` for writing, called from the script's own code, to `listener`; returns its remover."""
    if not _installed:
        _install()
    return _open_listeners.add(listener)
