"""Forward-side hooks: DDP's forward, the wrapped module's, any of its submodules' (a bypass), checkpoints, loaders.

Each hook writes one local fact into the step in progress. Nothing here communicates.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ddp_doctor.core.fingerprint import fingerprints
from ddp_doctor.core.frames import user_site
from ddp_doctor.core.phase import Phase
from ddp_doctor.observation import gradedits
from ddp_doctor.observation.autograd import walk_graph
from ddp_doctor.observation.hooks import Hook, tensors_in
from ddp_doctor.observation.steplog import MAX_SITES, StepLog
from ddp_doctor.observation.target import Target
from ddp_doctor.observation.timeline import Timeline

__all__ = ["ForwardHooks"]


class ForwardHooks:
    """What happens in forward: which modules ran, what is reachable from DDP's outputs, and calls that bypass DDP.

    `hook_outputs` is handed the outputs of each training forward so that the backward side can see when their
    backward pass starts.
    """

    def __init__(self, target: Target, timeline: Timeline, log: StepLog, hook_outputs: Any) -> None:
        self._t = target
        self._timeline = timeline
        self._log = log
        self._hook_outputs = hook_outputs
        self._ddp_depth = 0
        self._ddp_returned = False
        """DDP's forward hook ran for the call that is ending (False in `_on_ddp_forward_end`: the call raised)."""
        self._ddp_grad = False
        self._outside: list[bool] = []
        self._handles: list[Any] = []

    @property
    def inside_training_ddp_forward(self) -> bool:
        """Inside DDP's forward, which was called in grad mode."""
        return bool(self._ddp_depth) and self._ddp_grad

    def attach(self) -> None:
        """Register the hooks."""
        ddp, module = self._t.ddp, self._t.module
        self._handles += [
            ddp.register_forward_pre_hook(Hook(self._on_ddp_forward_pre)),
            ddp.register_forward_hook(Hook(self._on_ddp_forward)),
            ddp.register_forward_hook(Hook(self._on_ddp_forward_end), always_call=True),
            module.register_forward_pre_hook(Hook(self._on_module_forward_pre), with_kwargs=True),
            module.register_forward_hook(Hook(self._on_module_forward)),
            # Global module hooks catch a bypass through any submodule too: a loss computed by a method of the
            # inner module that calls its layers directly never runs the inner module's own forward.
            # (Global hooks are not attached to the model, so a copy or pickle of it never sees them.)
            register_module_forward_pre_hook(self._on_any_module_forward_pre),
            register_module_forward_hook(self._on_any_module_forward, always_call=True),
        ]

    def detach(self) -> None:
        """Remove every hook."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_ddp_forward_pre(self, _module: torch.nn.Module, _args: Any) -> None:
        tl = self._timeline
        self._ddp_depth += 1
        self._ddp_grad = torch.is_grad_enabled()
        if torch.is_grad_enabled():
            # A synced backward that no optimizer.step() followed: this forward starts another pass in the same
            # optimizer step (a retry path), or a GradScaler skipped the step. Where, for the report.
            unstepped = tl.pending_close and tl.attached and self._t.optimizer is not None
            tl.close_pending()
            if tl.attached and not tl.state.counters.ddp_forwards:
                self._check_versions()
            tl.phase = Phase.FORWARD
            tl.sync_forward = bool(self._t.ddp.require_backward_grad_sync)
            tl.inside_forward = True
            tl.state.pass_bit = 1  # the backward passes through this forward are told apart from the first
            tl.in_pass = False  # a pass that raised never ran its end callback
            if not tl.sync_forward:
                tl.state.sync_off = gradedits.sync_off_site(self._t.ddp)
            site = user_site({id(self._t.ddp)}) if tl.sync_forward else None
            if unstepped and tl.sync_forward and len(self._log.repeat_sites) < MAX_SITES:
                self._log.repeat_sites.append(f"step {self._log.steps}: {site}")
            elif site and site not in self._log.step_sites and len(self._log.step_sites) < MAX_SITES:
                self._log.step_sites.append(site)
            if tl.open_forward is not None:
                # The previous synced forward in grad mode got no backward (an evaluation through DDP with autograd
                # on): DDP prepared a reduction for it that nothing finishes. Harmless only if every rank does it.
                tl.state.counters.unpaired_forwards += 1
                if len(self._log.unpaired_sites) < MAX_SITES:
                    self._log.unpaired_sites.append(f"step {self._log.steps}: {tl.open_forward}")
            tl.open_forward = site
            now = time.perf_counter()
            tl.state.t_input += tl.clock.input_wait(now)
            tl.clock.forward_start = now
            if self._log.device is not None:
                self._log.device.on_forward()
        else:
            tl.clock.forward_start = time.perf_counter()
        if self._will_broadcast():
            # A collective DDP issues itself. After a forward without grad (or without sync) DDP skips the next
            # forward's broadcast, so a rank-0-only evaluation moves rank 0's broadcast to the evaluation: the
            # other ranks pair it with their next forward's, or with whatever collective comes first.
            counters = tl.state.counters
            counters.ddp_broadcasts += 1
            if not torch.is_grad_enabled():
                counters.eval_broadcasts += 1
                if len(self._log.broadcast_sites) < MAX_SITES:
                    self._log.broadcast_sites.append(f"step {self._log.steps}: {user_site({id(self._t.ddp)})}")

    def _will_broadcast(self) -> bool:
        """DDP's forward that is about to run broadcasts the module's buffers.

        Read before DDP's `_pre_forward`, this is what both of its checks ask: `_check_sync_bufs_pre_fwd` (the
        default) and `_check_sync_bufs_post_fwd` (a buffer hook registered for after the forward) are
        `will_sync_module_buffers()` and a location, and `require_forward_param_sync`, which it reads, changes
        only after both (in `_post_forward`). Not counted: the python reducer (compiled autograd) and a DDP whose
        parameters are all ignored skip the broadcast; under `join()` DDP first agrees on the source rank with an
        all-reduce and the joined ranks shadow the broadcast.
        """
        ddp = self._t.ddp
        will = getattr(ddp, "will_sync_module_buffers", None)
        if (
            will is None
            or getattr(ddp, "_use_python_reducer", False)
            or getattr(ddp, "_delay_all_reduce_all_params", False)
        ):
            return False
        join = getattr(ddp, "_join_config", None)
        return not (join is not None and join.enable) and bool(will())

    def _check_versions(self) -> None:
        """At a step's first training forward: parameters written since the optimizer's step (or since DDP was
        built, before step 0) were changed by something else. Once the optimizer is known, or before step 0."""
        tl = self._timeline
        if self._t.optimizer is None and self._log.steps:
            return
        moved = tl.versions.moved()
        load, tl.pending_load = tl.pending_load, None
        if not moved:
            return
        tl.state.counters.changed_outside = len(moved)
        how = f"load_state_dict at {load}" if load else "an in-place write (under torch.no_grad(), say)"
        self._log.note_step(self._log.changed_sites, f"{len(moved)} parameter tensor(s), {how}")
        if not self._log.changed_params:
            self._log.changed_params = moved[:64]

    def _on_ddp_forward(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        self._ddp_returned = True
        self._ddp_depth -= 1
        if not torch.is_grad_enabled():
            return
        tl = self._timeline
        tl.inside_forward = False
        step = tl.state
        step.counters.ddp_forwards += 1
        reachable, checkpoints = walk_graph(output, self._t.index)
        for i in reachable:
            step.reachable[i] = 1
        step.counters.reentrant_checkpoints += checkpoints
        tl.clock.last_forward_end = time.perf_counter()
        step.t_forward += tl.clock.last_forward_end - tl.clock.forward_start
        tl.phase = Phase.AFTER_FORWARD
        if tl.close_after_forward and tl.attached:
            tl.close_after_forward = False
            tl.close()

    def _on_ddp_forward_end(self, _module: torch.nn.Module, _args: Any, _output: Any) -> None:
        """After every DDP forward, one that raised too (`Join(throw_on_early_termination=True)` raises in DDP's
        pre-forward on every rank once one ran out, and the script catches it): a forward that raised prepared no
        reduction, so it is not a forward without backward, and the next call is not inside it."""
        if self._ddp_returned:
            self._ddp_returned = False
            return
        self._ddp_depth = max(self._ddp_depth - 1, 0)
        tl = self._timeline
        tl.inside_forward = False
        tl.open_forward = None

    def _on_module_forward_pre(self, _module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation under no_grad is not a training step
        tl = self._timeline
        tl.close_pending()
        tl.begin_if_needed()
        tl.phase = Phase.FORWARD
        step = tl.state
        if step.buffer_fp is None:
            # DDP broadcasts rank 0's buffers inside its forward, before this hook: what we see is what trains.
            step.buffer_fp = fingerprints(self._t.current_buffers())
        inputs = [t for t in tensors_in((args, kwargs)) if not t.is_complex()]
        if inputs:
            fps = fingerprints(inputs)
            # (a row is NaN for a tensor without data too: count plain floating-point tensors only)
            step.counters.inputs_nonfinite += sum(
                1
                for t, finite in zip(inputs, fps.isfinite().all(-1).tolist())
                if not finite and type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point()
            )
            step.input_fp += fps.nan_to_num(0.0).sum(0)
        if not step.counters.batch_size:
            step.counters.batch_size = next((int(t.shape[0]) for t in inputs if t.dim()), 0)
            step.counters.batchnorm_training = sum(m.training for m in self._t.batchnorm)

    def _on_module_forward(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._hook_outputs(output)

    def _on_any_module_forward_pre(self, module: torch.nn.Module, _args: Any) -> None:
        scan = self._log.state
        if (
            not self._ddp_depth
            and scan is not None
            and module is not self._t.ddp
            and id(module) not in self._t.submodules
        ):
            scan.beside_modules.enter(module)
        owned = self._t.owned.get(id(module))
        # Inside a training forward through DDP (even under no_grad or a checkpoint there), or a grad-mode call
        # outside it: the module runs as part of training. A no_grad evaluation outside DDP does not count.
        if owned is not None and (self._ddp_grad if self._ddp_depth else torch.is_grad_enabled()):
            ran = self._timeline.state.ran
            for i in owned:
                ran[i] = 1
        if self._ddp_depth or id(module) not in self._t.submodules:
            return
        counted = not self._outside and torch.is_grad_enabled()
        self._outside.append(counted)
        if not counted:
            return
        # The outermost call of the wrapped module, or of one of its submodules, with no DDP forward around it.
        tl = self._timeline
        tl.close_pending()
        tl.begin_if_needed()
        tl.state.counters.bypass_forwards += 1
        tl.sync_forward = bool(self._t.ddp.require_backward_grad_sync)
        tl.clock.forward_start = time.perf_counter()
        tl.phase = Phase.FORWARD
        if len(self._log.bypass_sites) < MAX_SITES:
            self._log.note_site(self._log.bypass_sites, user_site(self._t.submodules))

    def _on_any_module_forward(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not self._ddp_depth and self._log.state is not None:  # nothing inside DDP's forward was entered
            self._log.state.beside_modules.exit(module)
        if self._ddp_depth or id(module) not in self._t.submodules or not self._outside:
            return
        if self._outside.pop() and output is not None:
            tl = self._timeline
            tl.clock.last_forward_end = time.perf_counter()
            tl.state.t_forward += tl.clock.last_forward_end - tl.clock.forward_start
            tl.phase = Phase.AFTER_FORWARD
            self._hook_outputs(output)

    def on_checkpoint(self, site: str | None, needs_grad: bool) -> None:
        """A reentrant checkpoint call (from `checkpoints.listen`)."""
        # Only a training forward through this DDP model, with no grad-requiring input: its blocks get no gradient.
        if not needs_grad and self.inside_training_ddp_forward:
            self._log.note_site(self._log.blocked_checkpoints, site)
