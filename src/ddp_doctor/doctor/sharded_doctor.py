"""`observe()` on a model sharded with FSDP2 (`fully_shard`) or the FSDP2-based `replicate`: a `ShardedDoctor`.

It follows the optimizer's steps with the watch `ddp-doctor check` uses in a script without DDP
(`plain_watch.py`): which parameters the optimizer steps (one built before `fully_shard` holds the replaced ones),
the trainable parameters outside every sharded group and whether they differ across ranks, gradient sync at each
step, parameters that never get a gradient, whether any weight changed, shards saved with `torch.save`, the dtype
of one backward's reduce-scatters, the all-gathers per step and the step time. `report()` gathers them in a few
fixed-shape collectives (`sharded_report.py`) and gives every rank the same report.

What it knows less than the check: the script's lines. The check patches `Optimizer.__init__`, `fully_shard` and
`set_requires_gradient_sync` before the script runs, so its report says where the optimizer was made, which
`fully_shard` call built a module and where sync was switched off; `observe()` starts after all of that, so its
findings name the parameters, the modules and the fix without those lines. A failure of the run (a hang in an
all-gather some ranks entered alone) is the check's too: `observe()` sees one process, and only while it runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddp_doctor.core.errors import InvalidArgumentError, NoTrainableParametersError
from ddp_doctor.doctor.plain_watch import PlainOptimizerWatch
from ddp_doctor.exchange.runner import arrive
from ddp_doctor.observation import collectives, saves
from ddp_doctor.observation.hooks import StepHooks
from ddp_doctor.observation.wrapstate import require_process_group
from ddp_doctor.report import Report

__all__ = ["ShardedDoctor"]


class ShardedDoctor:
    """Context manager returned by `observe` for a model with FSDP2 modules in it. See `observe` for the arguments:
    without an optimizer (or with `"auto"`), the first optimizer that steps while the context is open is followed.
    `framework` (`"accelerate"`, from its integration) words the fixes; by default it is read from the first
    step's stack."""

    _serials = itertools.count()
    """Numbers this process's sharded doctors, so that each one's arrival at `report()` has its own store keys."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | str | None = None,
        *,
        steps: int | None = None,
        framework: str | None = None,
    ) -> None:
        require_process_group("observe()", launchers="torchrun or `ddp-doctor check`")
        if optimizer not in (None, "auto") and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f'optimizer must be a torch.optim.Optimizer, "auto" or None, got {optimizer!r}.')
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise InvalidArgumentError(f"steps must be a positive int or None, got {steps!r}.")
        params = list(model.parameters())
        if not any(p.requires_grad for p in params):
            raise NoTrainableParametersError(
                f"the sharded model has {len(params)} parameters and none requires a gradient, so there is nothing "
                "to train or synchronize. Set requires_grad=True on the parameters to train before fully_shard."
            )
        self.model = model
        self._given = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self._watch = PlainOptimizerWatch(model, self._given, framework=framework)
        self._max_steps = steps
        self._undo: list[Callable[[], None]] = []
        self._step_hooks = StepHooks()
        self._started = False
        self._finished = False
        self._serial = next(ShardedDoctor._serials)
        self._reports = 0

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer followed (given, or the first to step); None before its first step."""
        return self._watch.optimizer

    @property
    def steps_observed(self) -> int:
        return self._watch.steps

    @property
    def finished(self) -> bool:
        """True once every hook is removed (context exited, or `steps` reached)."""
        return self._finished

    def __enter__(self) -> ShardedDoctor:  # noqa: PYI034
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self.stop()
        return False

    def start(self) -> ShardedDoctor:
        """Attach the hooks (what entering the context does). Returns the doctor."""
        if self._started or self._finished:
            raise InvalidArgumentError("this observe() context was already used; call observe() again.")
        self._started = True
        register = self._given.register_step_post_hook if self._given is not None else register_optimizer_step_post_hook
        self._step_hooks.add("post", register, self._on_step)
        # First among the forward pre-hooks, before FSDP2's own all-gathers: the step clock's wait for data ends here.
        forward = self.model.register_forward_pre_hook(self._on_forward, prepend=True)
        self._undo = [
            forward.remove,
            saves.listen(self._watch.note_save),
            collectives.listen(self._watch.note_collective, fsdp=True),
        ]
        return self

    def stop(self) -> None:
        """Remove every hook and wrapper (what leaving the context does); what was measured stays for `report()`."""
        self._end_steps()  # its `remove` also takes out what a step left disarmed, now that none runs

    def _end_steps(self) -> None:
        """Stop observing: the optimizer's step hook is disarmed, and removed once no step runs it (`steps` ends
        inside it: `StepHooks`)."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self._step_hooks.remove()
        self._watch.detach()
        self._finished = True

    def _on_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._watch.on_step(optimizer) and self._max_steps is not None and self._watch.steps >= self._max_steps:
            self._end_steps()

    def _on_forward(self, _module: nn.Module, args: Any) -> None:
        self._watch.note_forward(args)

    def report(self, *, timeout: float = 300.0) -> Report:
        """Gather every rank's observations and diagnose them. Collective: every rank must call it.

        Args:
            timeout: seconds to wait for the other ranks to call `report()` too.

        Returns:
            The `Report`, identical on every rank; its `parallelism` is `fsdp2` or `replicate`.

        Raises:
            ReportTimeoutError: some rank did not call `report()` within `timeout`; the message names them.
            InvalidArgumentError: called inside the block, or no optimizer step was observed on this rank.
        """
        if self._started and not self._finished:
            raise InvalidArgumentError("report() was called inside the observe() block; call it after the block.")
        if self._watch.optimizer is None:
            which = "the optimizer given" if self._given is not None else "any optimizer"
            raise InvalidArgumentError(
                f"observe() saw no step of {which} on this rank, so there is nothing to report. Run at least one "
                "optimizer.step() inside the observe() block, on every rank."
            )
        self._reports += 1
        arrive(f"sharded{self._serial}/report{self._reports}", timeout=timeout)
        return self._watch.report()
