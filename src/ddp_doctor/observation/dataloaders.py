"""Which DataLoaders a rank iterates while it is observed, and how many batches each gives per epoch.

Ranks with different numbers of batches per epoch hang or crash at the end of the first epoch: the rank that runs
out stops calling DDP's all-reduce while the others wait in it. `DataLoader.__iter__` is wrapped once, process-wide;
each start of an iteration is passed to whoever listens (the observing doctors). Local facts only.
"""

from __future__ import annotations

import functools
import itertools
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
_SITE = "_ddp_doctor_site"
_SERIAL = "_ddp_doctor_serial"
_serials = itertools.count(1)
_passes: dict[int, dict[str, int]] = {}
"""id(iterator) -> {"yielded": n} of the passes started while someone listens: a pass that yields one batch and is
dropped (`next(iter(loader))` to read the batch size, as PyTorch's own DDP tutorial does before `set_epoch`) is a
peek, not an epoch. The same dict travels with the pass's start to the listeners."""
_MAX_PASSES = 64


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
    if getattr(loader, _SITE, None) is not None:
        info["site"] = getattr(loader, _SITE)
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
    original_init = tud.DataLoader.__init__

    @functools.wraps(original_init)  # frameworks read the signature to rebuild a loader (Lightning)
    def __init__(self: tud.DataLoader, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        # The creation line names the loader in findings; the serial tells loaders apart where an id may be reused
        # (a loader created anew each epoch can get the address of the last one).
        object.__setattr__(self, _SITE, user_site({id(self)}))  # a subclass's own __init__ is not the creation line
        object.__setattr__(self, _SERIAL, next(_serials))

    def __iter__(self: tud.DataLoader) -> Any:
        if not _listeners:
            _passes.clear()
            return original(self)
        info = describe(self)
        info["id"] = getattr(self, _SERIAL, None) or f"id{id(self)}"
        info["site"] = getattr(self, _SITE, None)
        if info["site"] is None:  # created before the probe was installed: its first iteration names it
            info["iterated_at"] = user_site()
        iterator = original(self)
        if len(_passes) >= _MAX_PASSES:
            _passes.clear()
        info["pass"] = _passes[id(iterator)] = {"yielded": 0}
        for listener in _listeners:
            listener(info)
        return iterator

    base = tud.dataloader._BaseDataLoaderIter
    original_next = base.__next__

    @functools.wraps(original_next)
    def __next__(self: Any) -> Any:
        batch = original_next(self)
        if _passes:
            counted = _passes.get(id(self))
            if counted is not None:
                counted["yielded"] += 1
        return batch

    base.__next__ = __next__  # type: ignore[method-assign]

    tud.DataLoader.__init__ = __init__  # type: ignore[method-assign]
    tud.DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
    original_set_epoch = tud.distributed.DistributedSampler.set_epoch

    def set_epoch(self: tud.distributed.DistributedSampler, epoch: int) -> None:
        _set_epoch_called.add(id(self))
        original_set_epoch(self, epoch)

    tud.distributed.DistributedSampler.set_epoch = set_epoch  # type: ignore[method-assign]
    _installed = True


def install() -> None:
    """Wrap `DataLoader.__init__`, `DataLoader.__iter__` and `DistributedSampler.set_epoch` now (the launcher does it
    before the script runs, so a set_epoch call before DDP is built, and every loader's creation line, are seen)."""
    if not _installed:
        _install()


def listen(listener: Listener) -> Callable[[], None]:
    """Pass each start of a DataLoader iteration to `listener`; returns the function that stops it."""
    if not _installed:
        _install()
    return _listeners.add(listener)
