"""The light watch that follows a script through its epoch ends after the observed steps (`check --follow-epochs`).

From the launch on, it registers every DataLoader the script iterates (its creation line, its real length, its
passes) and which pass each optimizer step trained on. At the end of the observed steps, `start` ends the training
pass in progress (its next batch raises StopIteration, so the script's own loop ends its epoch), caps every later
pass at `limit` batches, and times the points where every rank must meet: the script's collectives, DDP's buffer
broadcasts, DDP's gradient all-reduce before each optimizer step. Following ends at the first optimizer step of a
training pass started after the Nth epoch end (the epoch-end code, evaluation and checkpoint included, has run by
then), or when the script ends. Local facts only; nothing here communicates.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.following import COUNTED_PASSES, MAX_SYNC_POINTS, FollowRecord, LoaderSeen, SyncPoint
from ddp_doctor.core.frames import user_site, user_site_of
from ddp_doctor.observation import collectives, dataloaders, saves
from ddp_doctor.observation.collectives import Call
from ddp_doctor.observation.dataloaders import Pass
from ddp_doctor.observation.following_counted import LightningEpochs

__all__ = ["FollowWatch"]

_MAX_LOADERS = 32
_MAX_PASSES = 256
_MAX_FILES = 16


def _key(info: dict[str, Any]) -> str:
    """A loader by its creation line, its order among the loaders built together there, and its sampler (the same
    on every rank, whatever its length there): a loader created anew each epoch at one line is one loader; a
    training and a test loader built by one helper are #1 and #2 there (`dataloaders._at_site`)."""
    site = info.get("site") or info.get("iterated_at") or f"loader {info.get('id')}"
    return f"{site}#{info.get('ordinal', 1)}|{info.get('sampler')}|{info.get('shuffle')}"


class FollowWatch:
    """See the module docstring. `install` at launch; `on_step` before every optimizer step; `start` at the end of
    the observed steps; `stop` when following ends."""

    def __init__(self) -> None:
        self.loaders: dict[str, LoaderSeen] = {}
        self.active = False
        self.requested = 0
        self.limit = 0
        self.epoch_ends = 0
        self._nth_end: float | None = None
        self._started = 0.0
        self._syncs: list[SyncPoint] = []
        self._counts: dict[str, int] = {}
        self._passes: list[Pass] = []
        self._extra_sites: list[str] = []
        self._pending: tuple[float, str | None] | None = None
        self._entered: tuple[float, str, str | None] | None = None
        self._stops: list[Callable[[], None]] = []
        self._wrapped: list[DistributedDataParallel] = []
        self._latest: dict[str, Pass] = {}
        self._counted: list[LightningEpochs] = []
        self._first: dict[str, list[Pass]] = {}
        """Each loader's first `COUNTED_PASSES` passes: their batches are counted per rank and compared."""
        self.files: dict[str, dict[str, Any]] = {}
        """The files the script wrote (`torch.save`, `open()` for writing in its own code), by absolute path."""
        self.declined = False
        """Following was asked for, but the observed steps did not train on a DataLoader pass."""

    # ------------------------------------------------------------------------------------------- always on

    def install(self) -> None:
        dataloaders.listen(self._on_pass)
        dataloaders.listen_ends(self._on_end)
        saves.listen(functools.partial(self._on_write, "torch.save"))
        saves.listen_opens(functools.partial(self._on_write, "open()"))

    def _on_write(self, how: str, info: dict[str, Any]) -> None:
        path = info["path"]
        if path not in self.files and len(self.files) < _MAX_FILES:
            self.files[path] = {"path": path, "shown": info["shown"], "site": info.get("site"), "how": how}
            self.files[path]["existed"] = bool(info.get("existed"))

    def _on_pass(self, info: dict[str, Any]) -> None:
        key = _key(info)
        seen = self.loaders.get(key)
        if seen is None and len(self.loaders) < _MAX_LOADERS:
            seen = self.loaders[key] = LoaderSeen(
                key=key,
                site=info.get("site") or info.get("iterated_at"),
                batches=info.get("batches"),
                sampler=info.get("sampler"),
                ordinal=int(info.get("ordinal") or 1),
            )
        if seen is not None:
            seen.passes += 1
        one: Pass | None = info.get("pass")
        if one is not None:
            one.info["key"] = key
            if seen is not None:  # past `_MAX_LOADERS` loaders, the others are not listed
                self._latest[key] = one
                first = self._first.setdefault(key, [])
                if len(first) < COUNTED_PASSES:
                    first.append(one)
            if self.active and len(self._passes) < _MAX_PASSES:
                self._passes.append(one)

    def _on_end(self, one: Pass) -> None:
        seen = self.loaders.get(one.info.get("key", ""))
        if seen is not None:
            seen.most = max(seen.most, one.yielded)
            seen.capped += int(one.capped)
        if self.active and one.steps:
            self.epoch_ends += 1
            if self.epoch_ends == self.requested:
                self._nth_end = one.ended

    def on_step(self) -> bool:
        """An optimizer step is about to run (every optimizer's). True: following is done (the first step of a
        training pass started after the Nth epoch end)."""
        one = dataloaders.last_pass()  # the probe counts the step on it (`Pass.steps`)
        if one is not None:
            seen = self.loaders.get(one.info.get("key", ""))
            if seen is not None:
                seen.training = True
        if not self.active:
            return False
        if one is not None:
            for counted in self._counted:
                counted.on_step(one)
        if self._pending is not None:
            entered, site = self._pending
            self._pending = None
            self._sync("ddp-step", "DDP's gradient all-reduce after the forward", site, entered, time.perf_counter())
        return self._nth_end is not None and one is not None and one.started > self._nth_end

    def repeated_epoch(self) -> dict[str, Any] | None:
        """The first training loader with a shuffling DistributedSampler whose counted passes that were epochs
        started twice in a row with the same sampler epoch (`set_epoch` never called): its `site`, the `epoch` and
        the epochs `seen`, counting only the passes that were epochs (`Pass.was_epoch`: not a one-batch peek)."""
        for key, seen in self.loaders.items():
            first = self._first.get(key, [])
            if (
                not seen.training
                or seen.sampler != "DistributedSampler"
                or not first
                or not first[0].info.get("shuffle")
            ):
                continue
            epochs = [p.info.get("epoch") for p in first if p.was_epoch(seen.batches)]
            epochs = [e for e in epochs if e is not None]
            repeat = next((a for a, b in zip(epochs, epochs[1:]) if a == b), None)
            if repeat is not None:
                return {"site": seen.site, "epoch": repeat, "seen": epochs}
        return None

    # ------------------------------------------------------------------------------------------- following

    def can_start(self) -> bool:
        """Whether the observed steps trained on a DataLoader pass that is still open (not a step-based loop)."""
        training = dataloaders.last_pass()
        return training is not None and training.open and bool(training.steps)

    def start(self, requested: int, limit: int, models: Sequence[DistributedDataParallel], *, agreed: bool) -> bool:
        """End the pass the observed steps trained on and cap every later one; False (nothing changed) when
        `requested` is 0 or the ranks did not all pass `can_start` (`agreed`)."""
        if requested < 1 or not agreed:
            self.declined = requested >= 1
            return False
        self.requested, self.limit = requested, limit
        self.active = True
        self._started = time.perf_counter()
        training = dataloaders.last_pass()
        dataloaders.end_open_passes()
        dataloaders.cap_later_passes(limit)
        # A framework that schedules its epoch-end work by counting batches is told how short the pass now is.
        self._counted = [c for c in map(LightningEpochs.of, models) if c is not None]
        for counted in self._counted:
            if training is not None:
                counted.on_step(training)
        self._stops.append(collectives.listen(self._on_collective, self._on_collective_exit))
        for ddp in models:
            self._watch(ddp)
        return True

    def _watch(self, ddp: DistributedDataParallel) -> None:
        self._stops.append(ddp.register_forward_hook(self._on_ddp_forward).remove)
        original = getattr(ddp, "_sync_buffers", None)  # DDP's buffer broadcast at a forward (a private method)
        if original is None:
            return
        watch = self

        @functools.wraps(original)
        def _sync_buffers(*args: Any, **kwargs: Any) -> Any:
            site = user_site({id(ddp)})
            if not torch.is_grad_enabled() and site and site not in watch._extra_sites and len(watch._extra_sites) < 8:
                watch._extra_sites.append(site)
            entered = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                watch._sync("ddp-broadcast", "DDP's buffer broadcast", site, entered, time.perf_counter())

        ddp._sync_buffers = _sync_buffers  # an instance attribute: DDP's forward calls self._sync_buffers()
        self._wrapped.append(ddp)

    def _on_ddp_forward(self, ddp: torch.nn.Module, _args: Any, _output: Any) -> None:
        if torch.is_grad_enabled() and getattr(ddp, "require_backward_grad_sync", True):
            self._pending = (time.perf_counter(), user_site({id(ddp)}))

    def _on_collective(self, call: Call) -> None:
        self._entered = (time.perf_counter(), call.describe(), user_site_of(call.caller))

    def _on_collective_exit(self) -> None:
        if self._entered is None:
            return
        entered, what, site = self._entered
        self._entered = None
        self._sync("collective", what, site, entered, time.perf_counter())

    def _sync(self, kind: str, what: str, site: str | None, enter: float, exit_: float) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + 1
        if len(self._syncs) < MAX_SYNC_POINTS - 1:  # the last slot is the end of following
            self._syncs.append(SyncPoint(kind=kind, what=what, site=site, enter=enter, exit=exit_))

    def stop(self, ended_by: str, *, timeout_s: float | None) -> FollowRecord:
        """Stop watching; the record of what following saw (the caps stay: the rank leaves right after)."""
        now = time.perf_counter()
        for stop in self._stops:
            stop()
        self._stops.clear()
        for ddp in self._wrapped:
            ddp.__dict__.pop("_sync_buffers", None)
        self._wrapped.clear()
        followed = self.active
        self.active = False
        for key, one in self._latest.items():  # a pass still open (or left early by its loop) counts too
            self.loaders[key].most = max(self.loaders[key].most, one.yielded)
        for key, first in self._first.items():
            # A pass counts when it ran to its real end; one the check ended (capped) or the loop left early
            # gives a lower bound only.
            self.loaders[key].counted = [p.yielded if not p.open and not p.capped else -1 for p in first]
            self.loaders[key].floors = [p.yielded for p in first]
        if followed:
            self._syncs.append(
                SyncPoint(kind="end", what=f"the end of following ({ended_by})", site=None, enter=now, exit=now)
            )
        return FollowRecord(
            requested=self.requested,
            limit=self.limit,
            followed=followed,
            declined=self.declined,
            epoch_ends=self.epoch_ends,
            ended_by=ended_by,
            seconds=now - self._started if followed else 0.0,
            syncs=list(self._syncs),
            counts=dict(self._counts),
            passes=[_pass_row(p) for p in self._passes],
            loaders=list(self.loaders.values()),
            extra_broadcast_sites=list(self._extra_sites),
            timeout_s=timeout_s,
            started_at=self._started,
            files=list(self.files.values()),
        )


def _pass_row(one: Pass) -> dict[str, Any]:
    return {
        "site": one.info.get("site") or one.info.get("iterated_at"),
        "started": one.started,
        "ended": one.ended if one.ended is not None else (one.last or one.started),
        "yielded": one.yielded,
        "capped": one.capped,
        "batches": one.info.get("batches"),
    }
