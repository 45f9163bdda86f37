"""The `observe()` API: a `Doctor` attaches local hooks to a DDP model for its first steps, then diagnoses them.

Nothing here communicates until `report()`, which hands the finished record to `diagnose` (the exchange, the only
communication, then the pure analysis).

What is recorded, and from where:

- *used*: a post-accumulate-grad hook on each trainable parameter. It fires when autograd accumulates a gradient,
  which is exactly "this parameter reached the loss on this rank". DDP's reducer writes grads of unused parameters
  directly, so it does not fire this hook (`backward.py`).
- *reachable*: a walk of the autograd graph from DDP's forward outputs (what `find_unused_parameters=True` does).
  Used but unreachable means the parameter was used outside DDP's forward, or inside reentrant checkpointing
  (`autograd.py`).
- *bypass*: the wrapped module's forward ran in grad mode with no DDP forward around it, so DDP's reducer never
  fired (`forward.py`).
- fingerprints of grads when the optimizer steps, of weights after it, of buffers after DDP broadcast them, and of
  the inputs; and `requires_grad` of every parameter, to compare with the state DDP was built with (`steplog.py`).

A step is what the user thinks of as one: one `optimizer.step()` (or one synced backward when no optimizer is
given), so gradient accumulation with `no_sync()` or `require_backward_grad_sync=False` is one step of several
micro-steps (`timeline.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import TracebackType

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.codes import Code
from ddp_doctor.core.compat import is_sharded
from ddp_doctor.core.errors import DDPFailure, InvalidArgumentError, NoTrainableParametersError
from ddp_doctor.core.frames import user_site_of
from ddp_doctor.core.records import RankRecord
from ddp_doctor.doctor.pipeline import diagnose
from ddp_doctor.doctor.position import Position
from ddp_doctor.doctor.sharded_doctor import ShardedDoctor
from ddp_doctor.exchange.primitives import comm_device
from ddp_doctor.observation import dataloaders, saves
from ddp_doctor.observation.backward import BackwardHooks
from ddp_doctor.observation.crash import OBSERVE_HINT, CrashLog, explain_failure
from ddp_doctor.observation.device_clock import DeviceClock
from ddp_doctor.observation.forward import ForwardHooks
from ddp_doctor.observation.probes import Probes
from ddp_doctor.observation.steplog import StepLog
from ddp_doctor.observation.target import Target
from ddp_doctor.observation.timeline import Timeline
from ddp_doctor.observation.tree_scan import StateScan
from ddp_doctor.observation.wrapstate import comm_hook_of, model_info, require_ddp, require_process_group
from ddp_doctor.report import Report

__all__ = ["Doctor", "observe"]


def observe(
    ddp_model: DistributedDataParallel | nn.Module,
    optimizer: torch.optim.Optimizer | str | None = None,
    *,
    steps: int | None = None,
) -> Doctor | ShardedDoctor:
    """Watch a DDP model's training steps on this rank and diagnose them; or those of a model sharded with FSDP2
    (`fully_shard`, or the FSDP2-based `replicate`).

    Use it as a context manager around the first few steps of the user's own loop, on every rank. Then call
    `report()` on every rank: it is collective and every rank gets the same report.

    Args:
        ddp_model: the `DistributedDataParallel` model the loop trains, or the root of a sharded model (the
            module the loop calls, sharded itself or holding the sharded modules).
        optimizer: the optimizer the loop steps. A step is then one `optimizer.step()`; without it, a step is
            one backward pass that DDP synchronizes. `"auto"` adopts the first optimizer whose `step()` updates
            the model's parameters (what `ddp-doctor check` uses, since it cannot see the script's variables).
            For a sharded model a step is always an optimizer step; without one given, or with `"auto"`, the
            first optimizer to step is followed (an optimizer built before `fully_shard` holds none of the
            model's parameters, and that is a finding).
        steps: stop observing (and remove every hook) after this many steps; `None` observes until the context
            exits.

    Returns:
        A `Doctor`, the context manager; a `ShardedDoctor` for a sharded model.

    Raises:
        NotDDPModelError: `ddp_model` is neither a `DistributedDataParallel` nor a sharded model.
        ProcessGroupNotInitializedError: `torch.distributed` is not initialized.
        NoTrainableParametersError: no parameter of the model requires a gradient.
        InvalidArgumentError: `optimizer` or `steps` has an unusable value.

    Example:
        >>> with observe(ddp_model, optimizer=opt) as doctor:
        ...     for batch in batches[:8]:
        ...         loss_fn(ddp_model(batch)).backward(); opt.step(); opt.zero_grad()
        >>> report = doctor.report()
    """
    if is_sharded(ddp_model):
        return ShardedDoctor(ddp_model, optimizer, steps=steps)
    return Doctor(ddp_model, optimizer, steps=steps)  # type: ignore[arg-type]  (require_ddp names a wrong type)


class Doctor:
    """Context manager returned by `observe`. See `observe` for the arguments."""

    _serials = itertools.count()
    """Numbers this process's doctors, so that each one's exchange has its own store keys. Every rank builds its
    doctors in the same order (one per DDP model), so the numbers agree across ranks."""

    def __init__(
        self,
        ddp_model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer | str | None = None,
        *,
        steps: int | None = None,
    ) -> None:
        require_ddp(ddp_model, "observe()")
        require_process_group("observe()", launchers="torchrun or `ddp-doctor check`")
        auto = optimizer == "auto"
        if not auto and optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f'optimizer must be a torch.optim.Optimizer, "auto" or None, got {optimizer!r}.')
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise InvalidArgumentError(f"steps must be a positive int or None, got {steps!r}.")

        t = self._target = Target(ddp=ddp_model, optimizer=None if auto else optimizer, auto_optimizer=auto)
        self.info = model_info(ddp_model, list(zip(t.names, t.params)), t.buffers)
        if not any(p.requires_grad for p in t.params):
            raise NoTrainableParametersError(
                f"the DDP model has {len(t.params)} parameters and none requires a gradient, so there is "
                "nothing to train or synchronize. Set requires_grad=True on the parameters to train before "
                "wrapping the model in DistributedDataParallel."
            )
        self.rank = dist.get_rank()
        self._serial = next(Doctor._serials)
        self._reports = 0
        self._finished = False
        self._hook_iteration = 0
        """post-local SGD hook's iteration when observing began (`comm_hook_of`)."""
        self._after: list[Callable[[], None]] = []
        self._crash = CrashLog()
        self._log = StepLog(t.params, t.buffers)
        self._log.device = DeviceClock.for_devices({p.device for p in t.params})
        self._log.state = StateScan(
            t.module,
            t.registered,
            t.params,
            lambda: t.optimizer,
            buffer_slots=t.buffer_slots,
            broadcast_buffers=self.info.buffers_synced,
            beside=t.beside,
        )
        self._timeline = Timeline(
            log=self._log,
            params=t.params,
            max_steps=steps,
            on_new_step=self._on_new_step,
            on_done=self._on_done,
            on_phase=self._on_phase,
        )
        self._backward = BackwardHooks(t, self._timeline)
        self._forward = ForwardHooks(t, self._timeline, self._log, self._backward.hook_outputs)
        self._listeners = Probes(self._timeline, self._log, self._forward, t)
        self.position = Position(t, self._timeline, self._log, self._crash)
        """Where this rank is, for the launcher to publish (`position.py`)."""
        self.on_phase: Callable[[Doctor], None] | None = None
        """Called at every phase change (the launcher publishes the rank's position with it)."""
        self.on_steps_done: Callable[[Doctor], None] | None = None
        """Called once when `steps` steps have been observed (used by the launcher to stop the script)."""

    # ----------------------------------------------------------------------------------------------- state

    @property
    def ddp(self) -> DistributedDataParallel:
        """The observed DDP model."""
        return self._target.ddp

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps close a step (given, or adopted with `optimizer="auto"`); None if none yet."""
        return self._target.optimizer

    @property
    def steps_observed(self) -> int:
        return self._log.steps

    @property
    def finished(self) -> bool:
        """True once every hook is removed (context exited, or `steps` reached)."""
        return self._finished

    # ----------------------------------------------------------------------------------------------- hooks

    def __enter__(self) -> Doctor:  # noqa: PYI034
        return self.start()

    def start(self) -> Doctor:
        """Attach the hooks (what entering the context does). Returns the doctor."""
        if self._timeline.attached or self._finished:
            raise InvalidArgumentError("this observe() context was already used; call observe() again.")
        # post-local SGD's hook counts DDP's iterations: the one the first observed step is (0 under the launcher)
        self._hook_iteration = ((comm_hook_of(self.ddp) or {}).get("local_sgd") or {}).get("iteration", 0)
        self._forward.attach()
        self._backward.attach()
        self._listeners.start()
        if self._log.state is not None:
            self._log.state.listen()
        self._timeline.attached = True
        return self

    def stop(self) -> None:
        """Close the step that is waiting for its optimizer step, and remove every hook (what a clean exit does)."""
        self._timeline.close_pending()
        if self._timeline.attached:
            self._detach()
        self._backward.release()
        self._finished = True

    def _detach(self) -> None:
        self._forward.detach()
        self._backward.detach()
        self._listeners.stop()
        if self._log.state is not None:
            self._log.state.stop()
        self._timeline.attached = False
        self._finished = True

    def listen_after_steps(self) -> None:
        """After the observed steps, keep recording DataLoader passes and checkpoint writes (`check` follows the
        script through its epoch ends) until `stop_listening`."""
        self._log.after_steps = True
        self._after = [dataloaders.listen(self._log.note_loader), saves.listen(self._log.note_save)]

    def stop_listening(self) -> None:
        for stop in self._after:
            stop()
        self._after = []

    def _on_new_step(self) -> None:
        self._backward.hook_new_trainable()

    def _on_done(self) -> None:
        self._detach()
        if self.on_steps_done is not None:
            self.on_steps_done(self)

    def _on_phase(self) -> None:
        if self.on_phase is not None:
            self.on_phase(self)

    # ----------------------------------------------------------------------------------------------- crashes

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            if exc is not None:
                self.record_crash(exc)
        finally:
            self.stop()
        failure = self.explain(exc) if exc is not None else None
        if failure is not None:
            raise failure from exc
        return False

    def record_crash(self, exc: BaseException) -> None:
        """Record that the observed loop died with `exc` (the launcher calls this for crashes outside the context)."""
        tl = self._timeline
        if (
            self._crash.note(exc, step=self._log.steps, in_window=tl.attached, ddp=self.ddp)
            and tl.state.active
            and tl.attached
        ):
            if tl.state.pass_bit > 1:
                # It failed after a backward pass through the same forward: where, as the line of the pass that failed
                # (Lightning's second manual_backward fails before autograd runs, so no hook saw that pass start).
                _note_failed_pass(tl.state.pass_sites, exc)
            tl.close(complete=False)

    def explain(self, exc: BaseException, *, hint: str = OBSERVE_HINT) -> DDPFailure | None:
        """DDP's own error `exc`, explained with parameter names; None when it is not one of DDP's. `hint` ends the
        message (`ddp-doctor check` reports by itself and passes "")."""
        self.record_crash(exc)
        if self._crash.kind_name not in (Code.REDUCTION_ERROR, "static-graph-changed", "mark-ready-twice"):
            return None
        return explain_failure(
            exc,
            kind=self._crash.kind_name,
            rank=self.rank,
            info=self.info,
            record=self._log.record(self.rank),
            crash_in_window=self._crash.in_window,
            hint=hint,
        )

    # ----------------------------------------------------------------------------------------------- output

    def record(self) -> RankRecord:
        """This rank's observations so far, as plain data."""
        record = self._log.record(self.rank)
        record.comm_hook = comm_hook_of(self.ddp)
        if record.comm_hook and "local_sgd" in record.comm_hook:
            record.comm_hook["local_sgd"]["observed_from"] = self._hook_iteration
        record.model_averaging = self._listeners.averagings.found
        if self._log.state is not None:
            record.beside_modules = list(self._log.state.beside_modules.entries)
        record.graph_collectives = self._listeners.graph.found
        self._crash.stamp(record)
        return record

    def report(self, *, timeout: float = 300.0) -> Report:
        """Exchange every rank's record and diagnose them. Collective: every rank must call it.

        Args:
            timeout: seconds to wait for the other ranks to call `report()` too.

        Returns:
            The `Report`, identical on every rank.

        Raises:
            ReportTimeoutError: some rank did not call `report()` within `timeout`; the message names them.
            RankMismatchError: the ranks observed models with different parameter lists.
        """
        if self._timeline.attached:
            raise InvalidArgumentError("report() was called inside the observe() block; call it after the block.")
        self._reports += 1
        # Each DDP model is compared within its own process group (a hybrid-parallel job's data-parallel group).
        group = self.ddp.process_group
        params = self._target.params
        device = comm_device(group, params[0].device if params else None)
        return diagnose(
            self.record(),
            self.info,
            group=group,
            device=device,
            timeout=timeout,
            tag=f"doctor{self._serial}/report{self._reports}",
        )


def _note_failed_pass(sites: list[str], exc: BaseException) -> None:
    """Add the user's line on the traceback of `exc` (where the failed backward pass was called) to `sites`."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    site = user_site_of(tb.tb_frame, None) if tb is not None else None
    if site and site not in sites and len(sites) < 4:
        sites.append(site)
