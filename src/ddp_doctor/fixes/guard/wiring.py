"""The guard's hooks on DDP, the module inside it and the optimizer, and what each event triggers.

Every hook is registered through `ddp_doctor.observation.hooks.Hook`: a model deep-copied or pickled while guarded (an EMA
copy, ``torch.save(model)``) gets a no-op in its place instead of dragging the guard along.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core import log as _log
from ddp_doctor.core.errors import GuardError
from ddp_doctor.core.frames import user_site
from ddp_doctor.fixes.guard.compare import due
from ddp_doctor.fixes.guard.problems import LOGGER_NAME
from ddp_doctor.observation.hooks import Hook
from ddp_doctor.observation.model_averaging import AveragingsDone, local_sgd_began

if TYPE_CHECKING:
    from ddp_doctor.fixes.guard.bypass import BypassWatch
    from ddp_doctor.fixes.guard.compare import ReplicaCheck
    from ddp_doctor.fixes.guard.flips import FlipWatch
    from ddp_doctor.fixes.guard.problems import Reporter

__all__ = ["Hooks", "StepCount"]

logger = logging.getLogger(LOGGER_NAME)


class StepCount(Protocol):
    """What the hooks read and advance of the guard (its `Guard`): the step count, the schedule, on or off."""

    steps: int
    every: int

    @property
    def active(self) -> bool: ...


class Hooks:
    """Registers the guard's hooks and turns events into checks. Holds the per-step event state."""

    def __init__(
        self,
        guard: StepCount,
        *,
        bypass: BypassWatch,
        flips: FlipWatch,
        replicas: ReplicaCheck,
        reporter: Reporter,
        params: list[torch.nn.Parameter],
        rank: int,
        check: Callable[[str], Any],
    ) -> None:
        self._g = guard
        """Read and advanced through its public attributes only: `steps`, `every`, `active`."""
        self._bypass, self._flips, self._replicas, self._reporter = bypass, flips, replicas, reporter
        self._params, self._rank = params, rank
        self._check = check
        """Compares the replicas now (the guard's scheduled check), with the reason in words."""
        self._ddp: DistributedDataParallel | None = None
        self._stepper = False
        """The guard was given the optimizer: a step is its `step()`, not a synchronizing forward."""
        self.depth = 0
        """How many DDP forwards are running now (a module call at depth 0 bypasses DDP)."""
        self.ddp_forwards = 0
        """Grad-mode DDP forwards since the last optimizer step."""
        self._handles: list[Any] = []
        self._ddp_handles: list[Any] = []
        self._averagings: AveragingsDone | None = None
        """Model averagings, listened to once post-local SGD began (no cost to a job without it)."""
        self._stop_listening: Callable[[], None] | None = None
        self._waiting = False
        """A comparison is due under post-local SGD: it waits for the next model averaging to be done."""

    # ------------------------------------------------------------------------------------------ registration

    def attach(
        self, ddp: DistributedDataParallel, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> None:
        self._stepper = optimizer is not None
        self.attach_ddp(ddp)
        self._handles.append(module.register_forward_pre_hook(Hook(self.on_module_forward_pre)))
        self._handles.append(module.register_state_dict_pre_hook(Hook(self.on_state_dict)))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(Hook(self.on_optimizer_pre)))
            self._handles.append(optimizer.register_step_post_hook(Hook(self.on_optimizer_step)))
        self._bypass.arm(self.on_any_module_forward_pre)

    def attach_ddp(self, ddp: DistributedDataParallel) -> None:
        self._ddp = ddp
        self._ddp_handles = [
            ddp.register_forward_pre_hook(Hook(self.on_ddp_forward_pre)),
            # always_call: the depth must come back down even when DDP's forward raises.
            ddp.register_forward_hook(Hook(self.on_ddp_forward), always_call=True),
        ]

    def detach_ddp(self) -> None:
        for h in self._ddp_handles:
            h.remove()
        self._ddp_handles.clear()
        self.depth = 0

    def detach(self) -> None:
        self._bypass.disarm()
        self.detach_ddp()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None

    # ------------------------------------------------------------------------------------------------ events

    def _safely(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a local detector; an internal error turns the guard off instead of taking training down."""
        g = self._g
        if not g.active or self._reporter.broken:
            return None
        try:
            return fn(*args)
        except GuardError:
            raise
        except Exception as exc:  # noqa: BLE001  (the guard must never take training down)
            self._reporter.fail(exc)
            return None

    def on_ddp_forward_pre(self, _module: torch.nn.Module, _args: Any) -> None:
        g = self._g
        self.depth += 1
        if torch.is_grad_enabled():
            self.ddp_forwards += 1
            self._safely(self._flips.check, g.steps)
            if not self._stepper and (self._ddp is not None and self._ddp.require_backward_grad_sync):
                self._count_step()

    def on_ddp_forward(self, _module: torch.nn.Module, _args: Any, _output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if not self._stepper and self._bypass.armed and torch.is_grad_enabled():
            self._bypass.disarm()  # a healthy forward: from here the inner module's hook suffices

    def on_module_forward_pre(self, _module: torch.nn.Module, _args: Any) -> None:
        if self.depth == 0 and torch.is_grad_enabled():
            self._safely(self._bypass.called_directly, user_site(), self._g.steps)
            if not self._stepper:
                self._count_step()

    def on_any_module_forward_pre(self, module: torch.nn.Module, _args: Any) -> None:
        bypass = self._bypass
        if self.depth == 0 and id(module) in bypass.submodules and torch.is_grad_enabled():
            self._safely(bypass.called_directly, user_site(bypass.submodules), self._g.steps)

    def on_optimizer_pre(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        g = self._g
        if self.ddp_forwards == 0:
            self._safely(self._bypass.unsynced_step, self._params, self._flips.wrap_trainable, g.steps)
        size = self._averagings.take() if self._averagings is not None else None
        group = getattr(self._ddp, "process_group", None)
        if self._waiting and g.active and size is not None and group is not None and size == group.size():
            self._waiting = False
            self._check(f"step {g.steps}, after the model averaging")

    def on_optimizer_step(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        g = self._g
        g.steps += 1
        if self.ddp_forwards and self._bypass.armed:
            self._bypass.disarm()  # a healthy step: from here the O(1) check suffices
        self.ddp_forwards = 0
        if self._averagings is not None:
            self._averagings.take()  # an averaging before this step's update is not one after it
        if g.active and due(g.steps, g.every):
            if self._ddp is not None and local_sgd_began(self._ddp):
                self._waiting = True  # the replicas differ between model averagings by design
                if self._averagings is None:
                    self._averagings = AveragingsDone()
                    self._stop_listening = self._averagings.start()
                _log.log_once(
                    logger,
                    logging.INFO,
                    f"ddp-doctor guard (rank {self._rank}): post-local SGD began (post_localSGD_hook); the replicas "
                    "differ between model averagings by design and are compared right after the next one.",
                )
            else:
                self._check(f"step {g.steps}")

    def _count_step(self) -> None:
        # Without an optimizer a step is a synchronizing forward; compare before the forward that starts step
        # k * every + 1, when the weights are those after k * every updates.
        g = self._g
        if g.active and due(g.steps, g.every):
            self._check(f"step {g.steps}")
        g.steps += 1

    def on_state_dict(self, *_args: Any, **_kwargs: Any) -> None:
        # Local only (state_dict() usually runs on rank 0 alone, so no collective here): it reports what the last
        # comparison already knows.
        g = self._g
        diverged = self._replicas.diverged
        if diverged and g.active:
            _log.log_once(
                logger,
                logging.ERROR,
                f"ddp-doctor guard (rank {self._rank}): saving a state_dict while the last comparison "
                f"found the replicas different ({', '.join(diverged[:4])}). Every rank's copy is "
                "not the same; call guard.before_save() on every rank before saving to see which.",
            )
