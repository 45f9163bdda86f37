"""The process-wide probes an observing doctor listens to while attached: reentrant checkpoint calls, DataLoader
iterations, GradScaler steps, gradient clipping calls and the script's own collectives (each probe wraps a torch
function once per process; see `reentrant`, `dataloaders`, `gradscaler`, `gradedits` and `collectives`). Also
silences torch's warning about global hooks around a compiled module while observing."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.core.frames import user_site
from ddp_doctor.observation import (
    collectives,
    dataloaders,
    gradedits,
    gradscaler,
    optimizers,
    reentrant,
    saves,
    weights,
)
from ddp_doctor.observation.collectives import Call
from ddp_doctor.observation.forward import ForwardHooks
from ddp_doctor.observation.graph_collectives import GraphCollectives
from ddp_doctor.observation.model_averaging import Averagings
from ddp_doctor.observation.steplog import StepLog
from ddp_doctor.observation.target import Target
from ddp_doctor.observation.timeline import Timeline

__all__ = ["Probes"]

_COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


class Probes:
    """Starts and stops one doctor's process-wide listeners."""

    def __init__(self, timeline: Timeline, log: StepLog, forward: ForwardHooks, target: Target) -> None:
        self._target = target
        self._timeline = timeline
        self._log = log
        self._forward = forward
        self._stops: list[Callable[[], None]] = []
        self.graph = GraphCollectives(lambda: log.steps)
        """The script's in-place reductions of tensors in the autograd graph (`RankRecord.graph_collectives`)."""
        self.averagings = Averagings(lambda: log.steps if timeline.state.started else log.steps - 1)
        """The steps after which a model averager averaged the parameters (`RankRecord.model_averaging`)."""
        self._warning_filter: tuple[Any, ...] | None = None

    def start(self) -> None:
        # torch warns at every forward of a DDP around a torch.compile'd module while global module hooks exist.
        # Ours are read-only observers that ignore the OptimizedModule's extra call (it owns no parameters and
        # runs inside DDP's forward); the warning would only alarm the user, so it is silenced while observing.
        warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)
        self._warning_filter = warnings.filters[0]
        self._stops = [
            reentrant.listen(self._forward.on_checkpoint),
            dataloaders.listen(self._log.note_loader),
            saves.listen(self._log.note_save),
            gradscaler.listen(self.on_scaler_step),
            collectives.listen(self.on_collective),
            optimizers.listen(self.on_scheduler_step),
            weights.listen(self.on_load_state_dict),
            gradedits.listen(self.on_grad_clip),
        ]

    def stop(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()
        if self._warning_filter is not None and self._warning_filter in warnings.filters:
            warnings.filters.remove(self._warning_filter)
            self._warning_filter = None

    def on_collective(self, call: Call) -> None:
        """The script entered a collective: part of the step in progress (while steps are observed)."""
        # The same call on another doctor's model counts there too: a script's collectives belong to the rank.
        if self._timeline.attached:
            site = user_site()
            self._log.note_collective(self._timeline.state, call, site)
            self.graph.note(call)
            self.averagings.note(call)
            if self._rereduced(call):
                self._timeline.state.counters.grads_rereduced += 1
                self._log.note_step(self._log.rereduce_sites, f"{call.signature()} at {site or 'an unknown place'}")

    def _rereduced(self, call: Call) -> bool:
        """`call` runs on the `.grad` of a parameter DDP synchronizes, after DDP reduced it in this step."""
        state, target = self._timeline.state, self._target
        if call.first is None or not state.counters.synced_backwards:
            return False
        if state.grad_ids is None:
            state.grad_ids = {id(p.grad): i for i, p in enumerate(target.params) if p.grad is not None}
        i = state.grad_ids.get(id(call.first))
        return i is not None and target.synced[i]

    def on_scheduler_step(self, scheduler: Any) -> None:
        """An LR scheduler's `step()`: counted in the step in progress when it schedules the observed optimizer."""
        tl = self._timeline
        if tl.attached and getattr(scheduler, "optimizer", None) is self._target.optimizer:
            tl.state.counters.scheduler_steps += 1
            site = user_site()
            self._log.note_step(self._log.scheduler_sites, f"{type(scheduler).__name__}.step() at {site}")
            metric = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
            if metric and site and site not in self._log.metric_schedulers and len(self._log.metric_schedulers) < 4:
                self._log.metric_schedulers.append(site)

    def on_load_state_dict(self, module: Any, site: str | None) -> None:
        """`load_state_dict` on the model (the DDP wrapper, the module inside or a submodule)."""
        target = self._target
        if self._timeline.attached and (module is target.ddp or id(module) in target.submodules):
            self._timeline.pending_load = site or "an unknown place"

    def on_grad_clip(self, call: str) -> None:
        """`clip_grad_norm_(max_norm=0.5) at file:line`: logged in the step in progress (while steps are observed).
        Whether it clipped these parameters, and alike on every rank, the gradients' fingerprints at the optimizer
        step tell; this names the line when they differ."""
        if self._timeline.attached:
            self._log.note_step(self._log.grad_edit_sites, call)

    def on_scaler_step(self, scale: float) -> None:
        """`GradScaler.step` with this loss scale, in the step in progress."""
        if self._timeline.attached:
            self._timeline.state.counters.scaler_scale = gradscaler.encode(scale)
