"""Which DataLoaders a rank iterates while it is observed, and how many batches each gives per epoch.

Ranks with different numbers of batches per epoch hang or crash at the end of the first epoch: the rank that runs
out stops calling DDP's all-reduce while the others wait in it. `DataLoader.__iter__` is wrapped once, process-wide;
each start of an iteration is passed to whoever listens (the observing doctors, the launcher's epoch following).
Local facts only.

Each pass (one `iter(loader)`) is a `Pass`: its batches, its start and end, and an optional cap. `check` follows a
script through its epoch ends by capping passes (`end_open_passes`, `cap_later_passes`): a capped pass raises
StopIteration at its next batch, exactly as an exhausted one does, so the script's own loop ends the epoch.
`len(loader)` is never changed: it keeps returning the real length.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch.utils.data as tud
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ddp_doctor.core.frames import format_site, is_user_frame, user_site
from ddp_doctor.observation.datasets import dataset_digest
from ddp_doctor.observation.hooks import ListenerList

__all__ = [
    "Mark",
    "Pass",
    "cap_later_passes",
    "describe",
    "drawn_since",
    "end_open_passes",
    "install",
    "last_pass",
    "listen",
    "listen_ends",
]


@dataclass(eq=False, slots=True)
class Pass:
    """One iteration of a DataLoader (`iter(loader)`), as far as it went. Mutated by the wrapped iterator."""

    yielded: int = 0
    started: float = field(default_factory=time.perf_counter)
    """`time.perf_counter()` at `iter(loader)`."""
    ended: float | None = None
    """When it raised StopIteration (exhausted or capped); None while open, or when the loop left it early."""
    last: float | None = None
    """When its last batch was handed out."""
    cap: int | None = None
    """Raise StopIteration once this many batches were handed out (None: no cap)."""
    capped: bool = False
    """It ended at its cap, before its real end."""
    steps: int = 0
    """Optimizer steps taken while its batch was the last one handed out (a training pass has some)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The loader's `describe()` at the start of the pass, with `id` and `site`."""

    @property
    def open(self) -> bool:
        return self.ended is None

    def was_epoch(self, batches: int | None) -> bool:
        """Whether the pass counts as an epoch of a loader of `batches` batches: it ran into `check`'s cap while
        following, an optimizer step trained on it (following stops at the next epoch's first step), or it handed
        out two batches (one when that is all there is). One batch dropped before its cap is a peek at the data."""
        return self.yielded >= min(2, batches or 2) or self.capped or bool(self.steps)


Listener = Callable[[dict[str, Any]], None]
EndListener = Callable[[Pass], None]
_listeners: ListenerList[Listener] = ListenerList()
_end_listeners: ListenerList[EndListener] = ListenerList()
_installed = False
_set_epoch_called: set[int] = set()
"""ids of DistributedSamplers whose set_epoch was called since the probe was installed."""
_SITE = "_ddp_doctor_site"
_SERIAL = "_ddp_doctor_serial"
_ORDINAL = "_ddp_doctor_ordinal"
_serials = itertools.count(1)
_at_site: dict[str, list[int]] = {}
"""Per creation line: [loaders created there in this round, whether one of them started a pass since]. Loaders
built at one line (a helper that builds the training and the test loader) are told apart by their order in a round
of creation: a round ends when a loader of the line starts a pass, so a loader built anew each epoch at that line
is the same loader again (#1), and a training and a test loader built together are #1 and #2."""
_passes: dict[int, Pass] = {}
"""id(iterator) -> its `Pass`, for the passes started while someone listens: a pass that yields one batch and is
dropped (`next(iter(loader))` to read the batch size, as PyTorch's own DDP tutorial does before `set_epoch`) is a
peek, not an epoch. The same object travels with the pass's start to the listeners (`info["pass"]`)."""
_MAX_PASSES = 64
_MAX_FRAMES = 40
_state: dict[str, Any] = {"cap": None, "last": None}
"""`cap`: the cap of passes started from now on (None: none); `last`: the `Pass` whose batch was handed out last."""


def describe(loader: tud.DataLoader) -> dict[str, Any]:
    """`len(loader)` (None for an iterable dataset without a length), the sampler's kind and its padding."""
    try:
        batches: int | None = len(loader)
    except TypeError:
        batches = None
    sampler = _ordering_sampler(loader)
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
    if _reads_whole(loader, sampler) and batches is not None:
        # It orders the whole dataset on this rank: whether that is one dataset for every rank (`shards-overlap`).
        info["dataset"] = len(sampler.data_source) if hasattr(sampler.data_source, "__len__") else None
        info["dataset_digest"] = dataset_digest(loader.dataset)
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
        # What decides which indices this rank reads (`shards-overlap`): the same on every rank but the rank.
        info["seed"] = int(sampler.seed)
        info["drop_last"] = bool(sampler.drop_last)
        info["num_replicas"] = int(sampler.num_replicas)
        info["rank"] = int(sampler.rank)
        # What it samples: one dataset on every rank, or each rank its own (a `random_split` under a per-rank seed).
        info["sampled_digest"] = dataset_digest(sampler.dataset)
        info["exact"] = type(sampler) is tud.distributed.DistributedSampler
        info["set_epoch_called"] = id(sampler) in _set_epoch_called
    return info


def _reads_whole(loader: tud.DataLoader, sampler: Any) -> bool:
    """The loader hands this rank every sample its sampler orders, and that sampler orders the whole dataset: a
    plain DataLoader whose plain BatchSampler holds a RandomSampler or SequentialSampler. Not a loader that shards
    its batches itself (Accelerate's BatchSamplerShard, or its DataLoaderDispatcher, which reads on rank 0 and
    hands each rank a slice)."""
    batches = getattr(loader, "batch_sampler", None)
    return (
        type(loader) is tud.DataLoader
        and type(batches) is tud.BatchSampler
        and batches.sampler is sampler
        and type(sampler) in (tud.RandomSampler, tud.SequentialSampler)
    )


def _ordering_sampler(loader: tud.DataLoader) -> Any:
    """The sampler that orders the loader's samples. Given a batch sampler, `DataLoader.sampler` is a placeholder
    SequentialSampler and the real one sits inside the batch sampler, or one level deeper: Accelerate's
    BatchSamplerShard wraps the original BatchSampler (a shuffling training loader and an evaluation loader it
    prepared would otherwise both read SequentialSampler)."""
    batches = getattr(loader, "batch_sampler", None)
    for _ in range(3):
        inner = getattr(batches, "sampler", None)
        if isinstance(inner, tud.Sampler) and not isinstance(inner, tud.BatchSampler):
            return inner
        batches = getattr(batches, "batch_sampler", None)
        if batches is None:
            break
    return getattr(loader, "sampler", None)


def _creation_site(loader: tud.DataLoader, frame: FrameType | None) -> tuple[str | None, Any]:
    """`file:line` where `loader` was created, walking out from `frame` (its `__init__`'s caller), and the user's
    loader it was built from by a framework (None: the user's own, or unknown).

    Frames whose locals hold `loader` itself are its making, not its creation: a subclass's `__init__`, or a
    framework's wrapper of `__init__` (Lightning wraps every DataLoader's while it calls `train_dataloader()`). A
    loader a framework builds from another one over the same data (Accelerate's prepare(), Lightning adding a
    DistributedSampler) is named by that one's line, found as a DataLoader in the framework's locals: the user's own
    line, and the same on every rank. A framework's loader from no loader (the HF Trainer's) is named by the
    framework's line."""
    data = loader.dataset
    sources = (data, getattr(data, "dataset", None))  # Accelerate wraps an iterable dataset in IterableDatasetShard
    first: str | None = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        filename = frame.f_code.co_filename
        if is_user_frame(filename, frameworks=False):
            values = list(frame.f_locals.values())
            if not any(v is loader for v in values):
                if is_user_frame(filename):  # the user's own code
                    return first or format_site(filename, frame.f_lineno), None
                for value in values:
                    if _is_observed_loader(value) and any(value.dataset is d for d in sources):
                        return getattr(value, _SITE), value
                first = first or format_site(filename, frame.f_lineno)
        frame = frame.f_back
    return first, None


def _is_observed_loader(value: Any) -> bool:
    """A DataLoader whose creation site is known (Accelerate's DataLoaderShard passes isinstance through a
    `__class__` property, but is not one)."""
    try:
        return isinstance(value, tud.DataLoader) and _SITE in getattr(value, "__dict__", {})
    except Exception:  # noqa: BLE001  (any object may sit in a framework's locals)
        return False


def _install() -> None:
    global _installed
    original = tud.DataLoader.__iter__
    original_init = tud.DataLoader.__init__

    @functools.wraps(original_init)  # frameworks read the signature to rebuild a loader (Lightning)
    def __init__(self: tud.DataLoader, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        # The creation line names the loader in findings; the serial tells loaders apart where an id may be reused
        # (a loader created anew each epoch can get the address of the last one).
        site, source = _creation_site(self, sys._getframe(1))
        object.__setattr__(self, _SITE, site)
        object.__setattr__(self, _SERIAL, next(_serials))
        if source is not None:  # a framework's loader over the user's: the user's loader again
            object.__setattr__(self, _ORDINAL, getattr(source, _ORDINAL, 1))
        elif site is not None:
            round_ = _at_site.setdefault(site, [0, 0])
            if round_[1]:
                round_[:] = [0, 0]
            round_[0] += 1
            object.__setattr__(self, _ORDINAL, round_[0])

    def __iter__(self: tud.DataLoader) -> Any:
        site = getattr(self, _SITE, None)
        if site in _at_site:  # the next loader created at its line starts a new round (see `_at_site`)
            _at_site[site][1] = 1
        if not _listeners:
            _passes.clear()
            return original(self)
        info = describe(self)
        info["id"] = getattr(self, _SERIAL, None) or f"id{id(self)}"
        info["site"] = getattr(self, _SITE, None)
        info["ordinal"] = getattr(self, _ORDINAL, 1)
        if info["site"] is None:  # created before the probe was installed: its first iteration names it
            info["iterated_at"] = user_site()
        iterator = original(self)
        if len(_passes) >= _MAX_PASSES:  # forget ended passes first: an open one may carry a cap
            for key in [k for k, p in _passes.items() if not p.open or p.cap is None][: _MAX_PASSES // 2]:
                del _passes[key]
        one = Pass(cap=_state["cap"], info=dict(info))
        info["pass"] = _passes[id(iterator)] = one
        for listener in _listeners:
            listener(info)
        return iterator

    base = tud.dataloader._BaseDataLoaderIter
    original_next = base.__next__

    @functools.wraps(original_next)
    def __next__(self: Any) -> Any:
        one = _passes.get(id(self)) if _passes else None
        if one is None:
            return original_next(self)
        if one.cap is not None and one.yielded >= one.cap:
            if one.open:
                one.capped = True
                _ended(one)
            raise StopIteration
        try:
            batch = original_next(self)
        except StopIteration:
            if one.open:
                _ended(one)
            raise
        one.yielded += 1
        one.last = time.perf_counter()
        _state["last"] = one
        return batch

    base.__next__ = __next__  # type: ignore[method-assign]

    tud.DataLoader.__init__ = __init__  # type: ignore[method-assign]
    tud.DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
    original_set_epoch = tud.distributed.DistributedSampler.set_epoch

    def set_epoch(self: tud.distributed.DistributedSampler, epoch: int) -> None:
        _set_epoch_called.add(id(self))
        original_set_epoch(self, epoch)

    tud.distributed.DistributedSampler.set_epoch = set_epoch  # type: ignore[method-assign]
    register_optimizer_step_pre_hook(_on_optimizer_step)
    _installed = True


def _on_optimizer_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
    """An optimizer step trains on the batch handed out last: its pass is a training pass."""
    one = _state["last"]
    if one is not None:
        one.steps += 1


def _ended(one: Pass) -> None:
    one.ended = time.perf_counter()
    for listener in _end_listeners:
        listener(one)


def last_pass() -> Pass | None:
    """The pass whose batch was handed out last (the training loop's, at an optimizer step)."""
    return _state["last"]


Mark = tuple[Pass | None, int]
"""A pass and how many batches it had handed out (`drawn_since`)."""


def drawn_since(mark: Mark) -> tuple[int, Mark]:
    """The batches the pass handed out last (the training loop's, at an optimizer step) gave since `mark` (all of
    its batches when it is a pass other than `mark`'s), and the mark to count the next step from."""
    one = _state["last"]
    if one is None:
        return 0, mark
    before, at = mark
    return one.yielded - (at if before is one else 0), (one, one.yielded)


def end_open_passes() -> list[Pass]:
    """Make every open pass raise StopIteration at its next batch (the loop in progress ends its epoch there).
    Returns them."""
    opened = [p for p in _passes.values() if p.open]
    for p in opened:
        p.cap = p.yielded
    return opened


def cap_later_passes(limit: int | None) -> None:
    """Passes started from now on hand out at most `limit` batches (None: no cap)."""
    _state["cap"] = limit


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


def listen_ends(listener: EndListener) -> Callable[[], None]:
    """Pass each pass that raised StopIteration (exhausted, or at its cap) to `listener`; returns its remover."""
    if not _installed:
        _install()
    return _end_listeners.add(listener)
