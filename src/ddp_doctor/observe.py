"""observe: watch the first steps of a DDP model on this rank, with local hooks only.

Nothing here communicates. Each hook writes one local fact into the current step's state; `Doctor.report()` hands
the finished record to `gather` (the only place that talks to other ranks) and then to `analyze`.

What is recorded, and from where:

- *used*: a post-accumulate-grad hook on each trainable parameter. It fires when autograd accumulates a gradient,
  which is exactly "this parameter reached the loss on this rank". DDP's reducer writes grads of unused parameters
  directly, so it does not fire this hook.
- *reachable*: a walk of the autograd graph from DDP's forward outputs (what `find_unused_parameters=True` does).
  Used but unreachable means the parameter was used outside DDP's forward, or inside reentrant checkpointing.
- *bypass*: the wrapped module's forward ran in grad mode with no DDP forward around it, so DDP's reducer never fired.
- fingerprints of grads when the optimizer steps, of weights after it, of buffers after DDP broadcast them, and of
  the inputs; and `requires_grad` of every parameter, to compare with the state DDP was built with.

A step is what the user thinks of as one: one `optimizer.step()` (or one synced backward when no optimizer is
given), so gradient accumulation with `no_sync()` or `require_backward_grad_sync=False` is one step of several
micro-steps.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ddp_doctor import _log, checkpoints, dataprobe
from ddp_doctor._collective import comm_device
from ddp_doctor.errors import (
    DDPFailure,
    InvalidArgumentError,
    NoTrainableParametersError,
)
from ddp_doctor.explain import OBSERVE_HINT, classify, explain_failure
from ddp_doctor.fingerprint import fingerprints
from ddp_doctor.hookutil import Hook as _Hook
from ddp_doctor.hookutil import tensors_in, user_site
from ddp_doctor.records import CRASH_KINDS, RankRecord, StepCounters
from ddp_doctor.wrapstate import model_info, require_ddp, require_process_group

__all__ = ["Doctor", "observe"]

logger = _log.get_logger(__name__)

_COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"
_MAX_SITES = 4


def observe(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer | str | None = None, *,
            steps: int | None = None) -> Doctor:
    """Watch a DDP model's training steps on this rank and diagnose them.

    Use it as a context manager around the first few steps of the user's own loop, on every rank. Then call
    `report()` on every rank: it is collective and every rank gets the same report.

    Args:
        ddp_model: the `DistributedDataParallel` model the loop trains.
        optimizer: the optimizer the loop steps. A step is then one `optimizer.step()`; without it, a step is
            one backward pass that DDP synchronizes. `"auto"` adopts the first optimizer whose `step()` updates
            the model's parameters (what `ddp-doctor check` uses, since it cannot see the script's variables).
        steps: stop observing (and remove every hook) after this many steps; `None` observes until the context
            exits.

    Returns:
        A `Doctor`, the context manager.

    Raises:
        NotDDPModelError: `ddp_model` is not a `DistributedDataParallel`.
        ProcessGroupNotInitializedError: `torch.distributed` is not initialized.
        NoTrainableParametersError: no parameter of the model requires a gradient.
        InvalidArgumentError: `optimizer` or `steps` has an unusable value.

    Example:
        >>> with observe(ddp_model, optimizer=opt) as doctor:
        ...     for batch in batches[:8]:
        ...         loss_fn(ddp_model(batch)).backward(); opt.step(); opt.zero_grad()
        >>> report = doctor.report()
    """
    return Doctor(ddp_model, optimizer, steps=steps)


class _Step:
    """The state of the step in progress."""

    def __init__(self, n_params: int) -> None:
        self.used = bytearray(n_params)
        self.reachable = bytearray(n_params)
        self.ran = bytearray(n_params)
        self.counters = StepCounters(complete=1)
        self.input_fp = torch.zeros(2, dtype=torch.float64)
        self.buffer_fp: torch.Tensor | None = None
        self.grad_fp: torch.Tensor | None = None
        self.started = False
        self.t_forward = 0.0
        self.t_backward = 0.0
        self.t_optimizer = 0.0

    @property
    def active(self) -> bool:
        return self.started or any(self.used)


class Doctor:
    """Context manager returned by `observe`. See `observe` for the arguments."""

    _serials = itertools.count()
    """Numbers this process's doctors, so that each one's exchange has its own store keys. Every rank builds its
    doctors in the same order (one per DDP model), so the numbers agree across ranks."""

    def __init__(self, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer | str | None = None, *,
                 steps: int | None = None) -> None:
        require_ddp(ddp_model, "observe()")
        require_process_group("observe()", launchers="torchrun or `ddp-doctor check`")
        self._auto_optimizer = optimizer == "auto"
        if self._auto_optimizer:
            optimizer = None
        elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer, \"auto\" or None, got {optimizer!r}.")
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise InvalidArgumentError(f"steps must be a positive int or None, got {steps!r}.")

        self._ddp = ddp_model
        self._module: torch.nn.Module = ddp_model.module
        self._optimizer = optimizer
        self._max_steps = steps
        self._named_params = list(self._module.named_parameters())
        self._params = [p for _, p in self._named_params]
        self._buffers = [b for _, b in self._module.named_buffers()]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.info = model_info(ddp_model, self._named_params, self._buffers)
        trainable_now = [p.requires_grad for p in self._params]
        if not any(trainable_now):
            raise NoTrainableParametersError(
                f"the DDP model has {len(self._params)} parameters and none requires a gradient, so there is "
                "nothing to train or synchronize. Set requires_grad=True on the parameters to train before "
                "wrapping the model in DistributedDataParallel.")

        self._submodules = {id(m) for m in self._module.modules()}
        # Each module's own (direct) parameters, by index: a module that runs is evidence its parameters are used.
        self._owned: dict[int, list[int]] = {}
        for m in self._module.modules():
            owned = [self._index[id(q)] for q in m.parameters(recurse=False) if id(q) in self._index]
            if owned:
                self._owned[id(m)] = owned
        self._ddp_grad = False
        self._blocked_checkpoints: list[str] = []
        self._repeat_sites: list[str] = []
        self._loaders: list[dict[str, Any]] = []
        self._stop_loaders: Callable[[], None] | None = None
        self._stop_checkpoints: Callable[[], None] | None = None
        self._warning_filter: tuple[Any, ...] | None = None
        self._outside: list[bool] = []
        self.rank = dist.get_rank()
        self._serial = next(Doctor._serials)
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._attached = False
        self._finished = False
        self._ddp_depth = 0
        self._sync_forward = True
        self._backward_pending = False
        self._t_forward_start = 0.0
        self._t_last_forward_end = 0.0
        self._t_optimizer_start = 0.0
        self._t_backward_end = 0.0
        self._pending_close = False
        self._reports = 0
        self.on_phase: Callable[[Doctor], None] | None = None
        """Called at every phase change (the launcher publishes the rank's position with it)."""
        self.phase = "before the first step"

        n = len(self._params)
        self._step = _Step(n)
        self._rows: dict[str, list[torch.Tensor]] = {k: [] for k in (
            "used", "reachable", "trainable", "ran", "grad_fp", "weight_fp", "buffer_fp", "input_fp", "timing",
            "counters")}
        self._rows["weight_fp"].append(fingerprints(self._params))
        self._crash_kind = 0
        self._crash_step = -1
        self._crash_message = ""
        self._crash_in_window = False
        self._bypass_sites: list[str] = []
        self.on_steps_done: Callable[[Doctor], None] | None = None
        """Called once when `steps` steps have been observed (used by the launcher to stop the script)."""

    @property
    def phase(self) -> str:
        """What this rank is doing, for the launcher's hang report."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        if self.on_phase is not None:
            self.on_phase(self)

    # ----------------------------------------------------------------------------------------------- set-up

    def __enter__(self) -> Doctor:  # noqa: PYI034
        return self.start()

    def start(self) -> Doctor:
        """Attach the hooks (what entering the context does). Returns the doctor."""
        if self._attached or self._finished:
            raise InvalidArgumentError("this observe() context was already used; call observe() again.")
        self._attach()
        return self

    def stop(self) -> None:
        """Close the step that is waiting for its optimizer step, and remove every hook (what a clean exit does)."""
        if self._attached:
            self._close_pending()
        if self._attached:
            self._detach()
        self._finished = True

    def _attach(self) -> None:
        ddp, module = self._ddp, self._module
        self._handles += [
            ddp.register_forward_pre_hook(_Hook(self._on_ddp_forward_pre)),
            ddp.register_forward_hook(_Hook(self._on_ddp_forward)),
            module.register_forward_pre_hook(_Hook(self._on_module_forward_pre), with_kwargs=True),
            module.register_forward_hook(_Hook(self._on_module_forward)),
            # Global module hooks catch a bypass through any submodule too (seed 002's loss is computed by a
            # method of the inner module that calls its layers, so the inner module's own forward never runs).
            register_module_forward_pre_hook(self._on_any_module_forward_pre),
            register_module_forward_hook(self._on_any_module_forward, always_call=True),
        ]
        if self._auto_optimizer:
            # The launcher does not know the script's optimizer: adopt the first one whose step() updates this
            # model's parameters (an Accelerate or Lightning wrapper calls the torch optimizer's step inside).
            self._handles += [
                register_optimizer_step_pre_hook(self._on_any_optimizer_pre),
                register_optimizer_step_post_hook(self._on_any_optimizer_post),
            ]
        elif self._optimizer is not None:
            self._handles += [
                self._optimizer.register_step_pre_hook(_Hook(self._on_optimizer_pre)),
                self._optimizer.register_step_post_hook(_Hook(self._on_optimizer_post)),
            ]
        # torch warns at every forward of a DDP around a torch.compile'd module while global module hooks exist.
        # Ours are read-only observers that ignore the OptimizedModule's extra call (it owns no parameters and
        # runs inside DDP's forward); the warning would only alarm the user, so it is silenced while observing.
        warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)
        self._warning_filter = warnings.filters[0]
        self._stop_checkpoints = checkpoints.listen(self._on_checkpoint)
        self._stop_loaders = dataprobe.listen(self._on_loader)
        self._hook_new_trainable()
        self._attached = True

    def _hook_new_trainable(self) -> None:
        """Hook every parameter that requires grad now; parameters unfrozen later are hooked at the next step."""
        for i, p in enumerate(self._params):
            if p.requires_grad and i not in self._hooked:
                self._handles.append(p.register_post_accumulate_grad_hook(_Hook(self._make_grad_hook(i))))
                self._hooked.add(i)

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._stop_checkpoints is not None:
            self._stop_checkpoints()
            self._stop_checkpoints = None
        if self._stop_loaders is not None:
            self._stop_loaders()
            self._stop_loaders = None
        if self._warning_filter is not None and self._warning_filter in warnings.filters:
            warnings.filters.remove(self._warning_filter)
            self._warning_filter = None
        self._hooked.clear()
        self._attached = False
        self._finished = True

    @property
    def ddp(self) -> DistributedDataParallel:
        """The observed DDP model."""
        return self._ddp

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps close a step (given, or adopted with `optimizer="auto"`); None if none yet."""
        return self._optimizer

    @property
    def steps_observed(self) -> int:
        return len(self._rows["used"])

    @property
    def finished(self) -> bool:
        """True once every hook is removed (context exited, or `steps` reached)."""
        return self._finished

    # ---------------------------------------------------------------------------------------------- hooks

    def _make_grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._step.used[i] = 1  # read _step at call time: it is replaced when a step closes

        return hook

    def _begin_step_if_needed(self) -> None:
        if not self._step.started:
            self._step.started = True
            self._hook_new_trainable()

    def _on_ddp_forward_pre(self, _module: torch.nn.Module, _args: Any) -> None:
        self._ddp_depth += 1
        self._ddp_grad = torch.is_grad_enabled()
        if torch.is_grad_enabled():
            # A synced backward that no optimizer.step() followed: this forward starts another pass in the same
            # optimizer step (a retry path), or a GradScaler skipped the step. Where, for the report.
            unstepped = self._pending_close and self._attached and self._optimizer is not None
            self._close_pending()
            self.phase = "forward"
            self._sync_forward = bool(self._ddp.require_backward_grad_sync)
            if unstepped and self._sync_forward and len(self._repeat_sites) < _MAX_SITES:
                self._repeat_sites.append(f"step {self.steps_observed}: {user_site({id(self._ddp)})}")
        self._t_forward_start = time.perf_counter()

    def _on_ddp_forward(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        self._ddp_depth -= 1
        if not torch.is_grad_enabled():
            return
        step = self._step
        step.counters.ddp_forwards += 1
        reachable, checkpoints = self._walk_graph(output)
        for i in reachable:
            step.reachable[i] = 1
        step.counters.reentrant_checkpoints += checkpoints
        self._t_last_forward_end = time.perf_counter()
        step.t_forward += self._t_last_forward_end - self._t_forward_start
        self.phase = "after forward, before backward"

    def _on_module_forward_pre(self, _module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation under no_grad is not a training step
        self._close_pending()
        self._begin_step_if_needed()
        self.phase = "forward"
        step = self._step
        if step.buffer_fp is None:
            # DDP broadcasts rank 0's buffers inside its forward, before this hook: what we see is what trains.
            step.buffer_fp = fingerprints(self._buffers)
        inputs = [t for t in tensors_in((args, kwargs)) if not t.is_complex()]
        if inputs:
            step.input_fp += fingerprints(inputs).nan_to_num(0.0).sum(0)

    def _on_module_forward(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self._hook_outputs(output)

    def _hook_outputs(self, output: Any) -> None:
        # The first gradient to reach an output marks the start of this forward's backward pass; from there we
        # queue a callback for its end. Hooking outputs (not parameters) keeps the callback on the outer graph
        # task even when reentrant checkpointing runs nested backward passes.
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_any_module_forward_pre(self, module: torch.nn.Module, _args: Any) -> None:
        owned = self._owned.get(id(module))
        # Inside a training forward through DDP (even under no_grad or a checkpoint there), or a grad-mode call
        # outside it: the module runs as part of training. A no_grad evaluation outside DDP does not count.
        if owned is not None and (self._ddp_grad if self._ddp_depth else torch.is_grad_enabled()):
            ran = self._step.ran
            for i in owned:
                ran[i] = 1
        if self._ddp_depth or id(module) not in self._submodules:
            return
        counted = not self._outside and torch.is_grad_enabled()
        self._outside.append(counted)
        if not counted:
            return
        # The outermost call of the wrapped module, or of one of its submodules, with no DDP forward around it.
        self._close_pending()
        self._begin_step_if_needed()
        self._step.counters.bypass_forwards += 1
        self._sync_forward = bool(self._ddp.require_backward_grad_sync)
        self._t_forward_start = time.perf_counter()
        self.phase = "forward"
        if len(self._bypass_sites) < _MAX_SITES:
            site = user_site(self._submodules)
            if site and site not in self._bypass_sites:
                self._bypass_sites.append(site)

    def _on_any_module_forward(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        if self._ddp_depth or id(module) not in self._submodules or not self._outside:
            return
        if self._outside.pop() and output is not None:
            self._t_last_forward_end = time.perf_counter()
            self._step.t_forward += self._t_last_forward_end - self._t_forward_start
            self.phase = "after forward, before backward"
            self._hook_outputs(output)

    def _on_checkpoint(self, site: str | None, needs_grad: bool) -> None:
        # Only a training forward through this DDP model, with no grad-requiring input: its blocks get no gradient.
        if (not needs_grad and self._ddp_depth and self._ddp_grad and site and site not in self._blocked_checkpoints
                and len(self._blocked_checkpoints) < _MAX_SITES):
            self._blocked_checkpoints.append(site)

    def _on_loader(self, info: dict[str, Any]) -> None:
        # The first loader iterated while observed is the training loader in the usual loop; later starts of the
        # same loader are new epochs.
        known = next((d for d in self._loaders if d["id"] == info["id"]), None)
        if known is not None:
            known["epochs_started"] += 1
            known["epochs_seen"].append(info.get("epoch"))
        elif len(self._loaders) < 4:
            self._loaders.append({**info, "epochs_started": 1, "epochs_seen": [info.get("epoch")],
                                  "first_step": self.steps_observed})

    def _on_output_grad(self, _grad: torch.Tensor) -> None:
        if not self._backward_pending and self._attached:
            self._backward_pending = True
            self.phase = "backward"
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward_queued)

    def _after_backward_queued(self) -> None:
        # DDP queues its finalize callback during the backward pass, after ours; queueing again runs us after it,
        # when the reduced gradients are in `.grad`.
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._backward_pending = False
        if not self._attached:
            return
        step = self._step
        step.counters.micro_steps += 1
        self._t_backward_end = time.perf_counter()
        step.t_backward += self._t_backward_end - self._t_last_forward_end
        self.phase = "after backward"
        if self._sync_forward:
            step.counters.synced_backwards += 1
            # The grads the optimizer will use: taken here rather than in the optimizer's pre-hook because a
            # closure-based step (Lightning) runs forward and backward inside optimizer.step().
            step.grad_fp = fingerprints(p.grad for p in self._params)
            if self._optimizer is None and not self._auto_optimizer:
                self._close_step()
            else:
                # Normally optimizer.step() closes the step. If the next forward comes first (no optimizer found
                # yet, or GradScaler skipped the step), that forward closes it.
                self._pending_close = True

    def _close_pending(self) -> None:
        if self._pending_close and self._attached:
            self._close_step()

    def _on_any_optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._optimizer is None and any(id(p) in self._index for g in opt.param_groups for p in g["params"]):
            self._optimizer = opt
        if opt is self._optimizer:
            self._on_optimizer_pre(opt, args, kwargs)

    def _on_any_optimizer_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt is self._optimizer:
            self._on_optimizer_post(opt, args, kwargs)

    def _on_optimizer_pre(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._step.grad_fp is None:
            self._step.grad_fp = fingerprints(p.grad for p in self._params)
        self._t_optimizer_start = time.perf_counter()
        self.phase = "optimizer step"

    def _on_optimizer_post(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        now = time.perf_counter()
        self._step.t_optimizer += now - max(self._t_optimizer_start, self._t_backward_end)
        self._step.counters.optimizer_step = 1
        self._close_step()

    def _walk_graph(self, output: Any) -> tuple[set[int], int]:
        """Parameters reachable from the autograd graph of `output`, and the number of reentrant checkpoints."""
        stack = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        seen: set[Any] = set()
        reachable: set[int] = set()
        checkpoints = 0
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)
            if variable is not None:
                i = self._index.get(id(variable))
                if i is not None:
                    reachable.add(i)
                continue
            if type(fn).__name__ == "CheckpointFunctionBackward":
                checkpoints += 1
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        return reachable, checkpoints

    # --------------------------------------------------------------------------------------------- steps

    def _close_step(self, *, complete: bool = True) -> None:
        step = self._step
        n = len(self._params)
        step.counters.complete = int(complete)
        rows = self._rows
        rows["used"].append(torch.tensor(list(step.used), dtype=torch.bool))
        rows["reachable"].append(torch.tensor(list(step.reachable), dtype=torch.bool))
        rows["ran"].append(torch.tensor(list(step.ran), dtype=torch.bool))
        rows["trainable"].append(torch.tensor([p.requires_grad for p in self._params], dtype=torch.bool))
        rows["grad_fp"].append(step.grad_fp if step.grad_fp is not None
                               else torch.full((n, 2), float("nan"), dtype=torch.float64))
        rows["weight_fp"].append(fingerprints(self._params))
        rows["buffer_fp"].append(step.buffer_fp if step.buffer_fp is not None
                                 else torch.full((len(self._buffers), 2), float("nan"), dtype=torch.float64))
        rows["input_fp"].append(step.input_fp)
        rows["timing"].append(torch.tensor([step.t_forward, step.t_backward, step.t_optimizer], dtype=torch.float64))
        rows["counters"].append(torch.tensor(step.counters.as_list(), dtype=torch.int64))
        self._step = _Step(n)
        self._pending_close = False
        self.phase = "between steps"
        if complete and self._max_steps is not None and self.steps_observed >= self._max_steps:
            self._detach()
            if self.on_steps_done is not None:
                self.on_steps_done(self)

    # ---------------------------------------------------------------------------------------------- exit

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        try:
            if exc is not None:
                self.record_crash(exc)
        finally:
            self.stop()
        failure = self.explain(exc) if exc is not None else None
        if failure is not None:
            raise failure from exc
        return False

    def explain(self, exc: BaseException, *, hint: str = OBSERVE_HINT) -> DDPFailure | None:
        """DDP's own error `exc`, explained with parameter names; None when it is not one of DDP's. `hint` ends the
        message (`ddp-doctor check` reports by itself and passes "")."""
        self.record_crash(exc)
        if self._crash_kind not in (1, 2, 3):
            return None
        return explain_failure(exc, kind=CRASH_KINDS[self._crash_kind], rank=self.rank, info=self.info,
                               rows=self._rows, crash_in_window=self._crash_in_window, hint=hint)

    def record_crash(self, exc: BaseException) -> None:
        """Record that the observed loop died with `exc` (the launcher calls this for crashes outside the context)."""
        if self._crash_kind:
            return
        kind = classify(exc)
        self._crash_kind = CRASH_KINDS.index(kind)
        self._crash_in_window = self._attached
        if self._step.active and self._attached:
            self._crash_step = self.steps_observed
            self._close_step(complete=False)
        else:
            self._crash_step = self.steps_observed
        self._crash_message = f"{type(exc).__name__}: {exc}"[:4000]

    # --------------------------------------------------------------------------------------------- output

    def record(self) -> RankRecord:
        """This rank's observations so far, as plain data."""
        rows = self._rows
        n, b = len(self._params), len(self._buffers)
        if not rows["used"]:
            record = RankRecord.empty(self.rank, n, b)
            record.weight_fp = rows["weight_fp"][0].unsqueeze(0)
        else:
            record = RankRecord(rank=self.rank, **{k: torch.stack(v) for k, v in rows.items()})
        record.crash_kind = self._crash_kind
        record.crash_step = self._crash_step
        record.crash_message = self._crash_message
        record.bypass_sites = list(self._bypass_sites)
        record.blocked_checkpoints = list(self._blocked_checkpoints)
        record.repeat_sites = list(self._repeat_sites)
        record.loaders = [{k: v for k, v in d.items() if k != "id"} for d in self._loaders]
        return record

    def report(self, *, timeout: float = 300.0) -> Any:
        """Exchange every rank's record and diagnose them. Collective: every rank must call it.

        Args:
            timeout: seconds to wait for the other ranks to call `report()` too.

        Returns:
            The `Report`, identical on every rank.

        Raises:
            ReportTimeoutError: some rank did not call `report()` within `timeout`; the message names them.
            RankMismatchError: the ranks observed models with different parameter lists.
        """
        from ddp_doctor.analyze import analyze
        from ddp_doctor.gather import gather
        from ddp_doctor.report import Report

        if self._attached:
            raise InvalidArgumentError("report() was called inside the observe() block; call it after the block.")
        self._reports += 1
        # Each DDP model is compared within its own process group (a hybrid-parallel job's data-parallel group).
        group = self._ddp.process_group
        device = comm_device(group, self._params[0].device if self._params else None)
        info, records = gather(self.record(), self.info, timeout=timeout, tag=f"doctor{self._serial}/report{self._reports}",
                               device=device, group=group)
        return Report.build(info, records, analyze(info, records), backend=str(dist.get_backend(group)))
