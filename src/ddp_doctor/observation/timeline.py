"""The step in progress: its phase, when it opens and closes, and the times of its parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddp_doctor.core.phase import Phase
from ddp_doctor.observation.dataloaders import Mark
from ddp_doctor.observation.steplog import StepLog, StepState
from ddp_doctor.observation.weights import VersionWatch

__all__ = ["Clock", "Timeline"]


@dataclass(slots=True)
class Clock:
    """`time.perf_counter()` marks within a step, from which its forward, backward and optimizer times are cut, and
    the waits: for the next batch (from `step_end` or `backward_end` to the forward) and in DDP's gradient
    communication (from `computed_end` to `backward_end`). 0.0: not seen yet."""

    forward_start: float = 0.0
    last_forward_end: float = 0.0
    computed_end: float = 0.0
    """Autograd finished computing the backward pass (before DDP's finalize waits for the all-reduce)."""
    backward_end: float = 0.0
    """DDP's finalize returned: the reduced gradients are in `.grad`."""
    optimizer_start: float = 0.0
    step_end: float = 0.0
    """The optimizer's step returned."""

    def input_wait(self, now: float) -> float:
        """Seconds from the end of the previous step (or micro-step's backward) to `now`; NaN when none was seen."""
        since = max(self.step_end, self.backward_end)
        return now - since if since else float("nan")


@dataclass(kw_only=True)
class Timeline:
    """Opens and closes steps, and says where the rank is (`phase`).

    A step is what the user thinks of as one: it closes at `optimizer.step()` (or, with no optimizer, after each
    synced backward), so gradient accumulation is one step of several micro-steps. It is written to `log` when it
    closes; after `max_steps` steps `on_done` is called (it removes the hooks).
    """

    log: StepLog
    params: list[torch.nn.Parameter]
    max_steps: int | None
    on_new_step: Callable[[], None]
    """Called when a step opens (hooks parameters unfrozen since the last one)."""
    on_done: Callable[[], None]
    on_phase: Callable[[], None]
    """Called at every phase change."""
    state: StepState = field(init=False)
    clock: Clock = field(default_factory=Clock)
    pending_close: bool = False
    """A synced backward ended and the optimizer step that closes the step has not come yet."""
    closed_computed: bool = False
    """The last closed step's synced backward computed its gradients (its used set was published then)."""
    attached: bool = False
    """The hooks are on: steps are being observed."""
    sync_forward: bool = True
    """The last training forward ran with `require_backward_grad_sync`: its backward is synced by DDP."""
    open_forward: str | None = None
    """Where the last synced DDP forward in grad mode was called, until a backward pass starts (then None)."""
    versions: VersionWatch = field(init=False)
    """The parameters' version counters as the optimizer (or DDP's constructor) left them."""
    in_pass: bool = False
    """A backward pass is in progress (its end is queued on autograd's engine)."""
    inside_forward: bool = False
    """A training forward through DDP is in progress (Lightning's manual optimization runs backward passes and
    optimizer steps inside it)."""
    close_after_forward: bool = False
    """The optimizer stepped inside DDP's forward: the step closes when that forward returns."""
    pending_load: str | None = None
    """Where `load_state_dict` was last called on the model since the optimizer's step (None: not called)."""
    drawn_from: Mark = (None, 0)
    """The DataLoader pass the last optimizer step trained on, and how many batches it had handed out then."""
    _phase: Phase = Phase.BEFORE_FIRST_STEP

    def __post_init__(self) -> None:
        self.state = StepState(len(self.params))
        self.versions = VersionWatch(self.params)

    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, value: Phase) -> None:
        self._phase = value
        self.on_phase()

    def begin_if_needed(self) -> None:
        if not self.state.started:
            self.state.started = True
            self.on_new_step()

    def close_pending(self) -> None:
        """Close the step whose synced backward ended, if the optimizer step never came to close it."""
        if self.pending_close and self.attached:
            self.close()

    def close(self, *, complete: bool = True) -> None:
        """Write the step in progress to the log and open a fresh one."""
        self.log.close(self.state, complete=complete)
        self.closed_computed = self.state.computed
        self.state = StepState(len(self.params))
        self.pending_close = False
        if complete:
            self.phase = Phase.BETWEEN_STEPS
        else:
            # A crashed step: the phase stays where it failed (a report names it when the rank is stopped before
            # it writes its own crash record); publishing again hands out what the step left without a gradient.
            self.on_phase()
        if complete and self.max_steps is not None and self.log.steps >= self.max_steps:
            self.on_done()
