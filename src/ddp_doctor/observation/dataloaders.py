"""Which DataLoaders a rank iterates while it is observed, and how many batches each gives per epoch.

Ranks with different numbers of batches per epoch hang or crash at the end of the first epoch: the rank that runs
out stops calling DDP's all-reduce while the others wait in it. `DataLoader.__iter__` is wrapped once, process-wide;
each start of an iteration is passed to whoever listens (the observing doctors). Local facts only.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch.utils.data as tud

from ddp_doctor.core.frames import user_site
from ddp_doctor.observation.hooks import ListenerList

__all__ = ["describe", "install", "listen"]

Listener = Callable[[dict[str, Any]], None]
_listeners: ListenerList[Listener] = ListenerList()
_installed = False
_set_epoch_called: set[int] = set()
"""ids of DistributedSamplers whose set_epoch was called since the probe was installed."""
_sites: dict[int, tuple[weakref.ref[tud.DataLoader], str]] = {}
"""id of each DataLoader built since the probe was installed -> (a weak reference to it, `file:line` of its
creation). An entry goes when its loader does."""


def describe(loader: tud.DataLoader) -> dict[str, Any]:
    """`len(loader)` (None for an iterable dataset without a length), the sampler's kind and its padding."""
    try:
        batches: int | None = len(loader)
    except TypeError:
        batches = None
    sampler = getattr(loader, "sampler", None)
    info: dict[str, Any] = {
        "batches": batches,
        "sampler": type(sampler).__name__ if sampler is not None else None,
        "padded": 0,
        "dataset": None,
        # What decides how fast it delivers (named by `input-bound`).
        "dataset_type": type(loader.dataset).__name__,
        "num_workers": int(loader.num_workers),
        "pin_memory": bool(loader.pin_memory),
        "persistent_workers": bool(loader.persistent_workers),
        "batch_size": loader.batch_size,
    }
    site = _sites.get(id(loader))
    if site is not None and site[0]() is loader:
        info["site"] = site[1]
    if isinstance(sampler, tud.distributed.DistributedSampler):
        try:
            size = len(sampler.dataset)  # type: ignore[arg-type]
        except TypeError:
            size = None
        info["dataset"] = size
        if size is not None and not sampler.drop_last:
            info["padded"] = int(sampler.total_size - size)
        info["epoch"] = int(sampler.epoch)
        info["shuffle"] = bool(sampler.shuffle)
        info["set_epoch_called"] = id(sampler) in _set_epoch_called
    return info


def _install() -> None:
    global _installed
    original = tud.DataLoader.__iter__

    def __iter__(self: tud.DataLoader) -> Any:
        if _listeners:
            info = describe(self)
            info["id"] = id(self)
            for listener in _listeners:
                listener(info)
        return original(self)

    tud.DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
    original_init = tud.DataLoader.__init__

    # `wraps` keeps the signature visible: Lightning and Accelerate read DataLoader.__init__'s parameters to rebuild
    # a loader with their own sampler.
    @functools.wraps(original_init)
    def __init__(self: tud.DataLoader, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        key = id(self)
        site = user_site({key})  # a subclass's own __init__ is not the creation line
        if site is not None:
            # A weak reference: the probe never keeps a loader (and its workers) alive.
            _sites[key] = (weakref.ref(self, lambda _: _sites.pop(key, None)), site)

    tud.DataLoader.__init__ = __init__  # type: ignore[method-assign]
    original_set_epoch = tud.distributed.DistributedSampler.set_epoch

    def set_epoch(self: tud.distributed.DistributedSampler, epoch: int) -> None:
        _set_epoch_called.add(id(self))
        original_set_epoch(self, epoch)

    tud.distributed.DistributedSampler.set_epoch = set_epoch  # type: ignore[method-assign]
    _installed = True


def install() -> None:
    """Wrap `DataLoader.__iter__` and `DistributedSampler.set_epoch` now (the launcher does it before the script
    runs, so a set_epoch call before DDP is built is seen too)."""
    if not _installed:
        _install()


def listen(listener: Listener) -> Callable[[], None]:
    """Pass each start of a DataLoader iteration to `listener`; returns the function that stops it."""
    if not _installed:
        _install()
    return _listeners.add(listener)
