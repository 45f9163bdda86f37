"""Backward-side hooks: which parameters got a gradient, when the backward pass ends, and the optimizer's step.

Each hook writes one local fact into the step in progress. Nothing here communicates.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ddp_doctor.core.fingerprint import fingerprints
from ddp_doctor.core.frames import user_site_of
from ddp_doctor.core.phase import Phase
from ddp_doctor.observation import dataloaders
from ddp_doctor.observation.hooks import Hook, StepHooks, tensors_in
from ddp_doctor.observation.optimizers import describe
from ddp_doctor.observation.steplog import StepState
from ddp_doctor.observation.target import Target
from ddp_doctor.observation.timeline import Timeline

__all__ = ["BackwardHooks"]

_SITE_STEPS = 2
"""The steps in which the line of each backward pass is looked up (a stack walk per pass), while no step's passes
were seen to use different parameters: the pattern shows in the first step it happens in, and in every step of a
GAN's loop."""


class BackwardHooks:
    """Gradients, the end of each backward pass, and the optimizer step that closes a step."""

    def __init__(self, target: Target, timeline: Timeline) -> None:
        self._t = target
        self._timeline = timeline
        self._hooked: set[int] = set()
        self._steps = StepHooks()
        self._handles: list[Any] = []
        self._backward_pending = False

    def attach(self) -> None:
        """Register the optimizer hooks and the gradient hooks of the parameters that require grad now."""
        t = self._t
        if t.auto_optimizer:
            # The launcher does not know the script's optimizer: adopt the first one whose step() updates this
            # model's parameters (an Accelerate or Lightning wrapper calls the torch optimizer's step inside).
            self._steps.add("pre", register_optimizer_step_pre_hook, self._on_any_optimizer_pre)
            self._steps.add("post", register_optimizer_step_post_hook, self._on_any_optimizer_post)
        elif t.optimizer is not None:
            self._steps.add("pre", t.optimizer.register_step_pre_hook, self._on_optimizer_pre)
            self._steps.add("post", t.optimizer.register_step_post_hook, self._on_optimizer_post)
            # The other optimizers: one that steps a tensor beside the model is compared too (`Target.beside`).
            self._steps.add("pre", register_optimizer_step_pre_hook, t.note_other)
        self.hook_new_trainable()

    def detach(self) -> None:
        """Remove every hook. The optimizer's step hooks are disarmed, and removed where no running step iterates
        them (the observed steps end inside one: `StepHooks`); `release` removes what was left."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()
        self._steps.remove()

    def release(self) -> None:
        """Remove the step hooks `detach` had to leave disarmed (call it from outside an optimizer step)."""
        self._steps.remove()

    def hook_new_trainable(self) -> None:
        """Hook every parameter that requires grad now; parameters unfrozen later are hooked at the next step."""
        for i, p in enumerate(self._t.params):
            if p.requires_grad and i not in self._hooked:
                self._handles.append(p.register_post_accumulate_grad_hook(Hook(self._grad_hook(i))))
                self._hooked.add(i)

    def _grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        timeline = self._timeline
        open_pass = self._open_pass

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                # DDP with find_unused_parameters=True runs this hook for a parameter that its graph search found
                # reachable but that the backward pass never reached (a GAN's generator in the discriminator's
                # pass, measured on torch 2.13): no gradient was accumulated, so the parameter was not used.
                return
            step = timeline.state  # read the state at call time: it is replaced when a step closes
            # The pass's bit, not just 1: the used set of each backward pass through one forward, with no pass over
            # the parameters per backward (StepLog.close compares them once per step).
            step.used[i] |= step.pass_bit
            if not timeline.in_pass:
                open_pass()

        return hook

    def _note_pass_site(self) -> None:
        tl = self._timeline
        sites = tl.state.pass_sites
        if tl.log.steps < _SITE_STEPS and not tl.log.pass_sites and len(sites) < 4:
            sites.append(user_site_of(sys._getframe(1), None) or "an unknown place")

    def _open_pass(self) -> None:
        # A backward pass that no forward output announced: one that runs inside DDP's forward (Lightning's
        # manual_backward in training_step), or whose first gradient reached a parameter before any output. Its end
        # is queued on the graph task it runs in.
        self._timeline.in_pass = True
        self._note_pass_site()
        torch.autograd.Variable._execution_engine.queue_callback(self._after_inner_pass)

    def _after_inner_pass(self) -> None:
        tl = self._timeline
        if tl.in_pass and tl.inside_forward and tl.attached:
            # DDP's finalize waits in this pass too (Lightning prepared the reduction from its loss): a synced pass.
            counters = tl.state.counters
            counters.inner_passes += 1
            counters.micro_steps += 1
            if tl.sync_forward:
                counters.synced_backwards += 1
        self._end_pass()

    def _end_pass(self) -> None:
        """The backward pass in progress ended: the next one through the same forward sets the next bit."""
        tl = self._timeline
        if tl.in_pass:
            tl.in_pass = False
            tl.state.pass_bit = min(tl.state.pass_bit << 1, 0x80)

    def hook_outputs(self, output: Any) -> None:
        """Watch a training forward's outputs for the start of their backward pass."""
        # The first gradient to reach an output marks the start of this forward's backward pass; from there we
        # queue a callback for its end. Hooking outputs (not parameters) keeps the callback on the outer graph
        # task even when reentrant checkpointing runs nested backward passes.
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, _grad: torch.Tensor) -> None:
        self._timeline.open_forward = None
        if not self._timeline.in_pass:
            self._timeline.in_pass = True
            self._note_pass_site()
        if not self._backward_pending and self._timeline.attached:
            self._backward_pending = True
            self._timeline.phase = Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward_queued)

    def _after_backward_queued(self) -> None:
        # The engine runs the queued callbacks in order once the graph is done. Ours was queued at the first
        # output gradient, before DDP's finalize (queued when its last bucket is ready), so this runs when
        # autograd has finished computing and before finalize waits for every bucket's all-reduce: the time from
        # here to `_after_backward` is the wait for the other ranks (and for the transfer still in flight).
        tl = self._timeline
        if tl.sync_forward:
            # Published now, not only at the step's end: a rank that waits here forever for a peer that never
            # reduces (a rank-dependent graph) still tells which parameters it trained.
            tl.state.computed = True
            tl.on_phase()
        tl.clock.computed_end = time.perf_counter()
        # DDP queues its finalize callback during the backward pass, after ours; queueing again runs us after it,
        # when the reduced gradients are in `.grad`.
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._backward_pending = False
        self._end_pass()
        tl = self._timeline
        if not tl.attached:
            return
        step = tl.state
        step.counters.micro_steps += 1
        tl.clock.backward_end = time.perf_counter()
        step.t_backward += tl.clock.backward_end - tl.clock.last_forward_end
        if tl.sync_forward:  # under no_sync DDP's finalize reduces nothing: no wait to count
            step.t_comm += tl.clock.backward_end - max(tl.clock.computed_end, tl.clock.last_forward_end)
        tl.phase = Phase.AFTER_BACKWARD
        if tl.sync_forward:
            step.counters.synced_backwards += 1
            # The grads as DDP's all-reduce left them. The optimizer's pre-hook compares what it is about to use
            # against these (code in between, clipping or logging, may change them on some ranks only); the
            # version counters let it fingerprint only the gradients written or replaced since.
            grads = [p.grad for p in self._t.params]
            step.synced_fp = fingerprints(grads)
            step.synced_grads = grads
            step.grad_present = [g is not None for g in grads]
            step.synced_versions = [0 if g is None else g._version for g in grads]
            step.grad_fp = None  # a pre-hook before this backward (a closure's) measured nothing the step uses
            if self._t.optimizer is None and not self._t.auto_optimizer:
                tl.close()
            else:
                # Normally optimizer.step() closes the step. If the next forward comes first (no optimizer found
                # yet, or GradScaler skipped the step), that forward closes it.
                tl.pending_close = True

    def _on_any_optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._t.optimizer is None and self._t.steps_params(opt):
            self._t.optimizer = opt
        if opt is self._t.optimizer:
            self._on_optimizer_pre(opt, args, kwargs)
        elif self._t.optimizer is not None:
            self._t.note_other(opt)

    def _on_any_optimizer_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt is self._t.optimizer:
            self._on_optimizer_post(opt, args, kwargs)

    def _grads_now(self, step: StepState, where: int) -> None:
        """Fingerprint the gradients the optimizer step uses, `where` (`StepCounters.grads_measured`)."""
        step.counters.grads_measured = where
        params = self._t.params
        if step.synced_fp is None:  # no synced backward in this step (no_sync throughout, a bypassed wrapper)
            step.grad_fp = fingerprints(p.grad for p in params)
            step.grad_present = [p.grad is not None for p in params]
            return
        changed = [
            i
            for i, (p, g, v) in enumerate(zip(params, step.synced_grads, step.synced_versions))
            if p.grad is not g or (g is not None and g._version != v)
        ]
        if not changed:
            step.grad_fp = step.synced_fp
            return
        # Written in place (clip_grad_norm_ multiplies every gradient, even by 1.0) or replaced since DDP reduced
        # them: fingerprint those again; the comparison across ranks tells whether their values changed alike.
        fp = step.synced_fp.clone()
        fp[changed] = fingerprints(params[i].grad for i in changed)
        step.grad_fp = fp
        step.grad_present = [p.grad is not None for p in params]

    def _on_optimizer_pre(self, opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        tl = self._timeline
        if tl.state.counters.micro_steps:
            self._grads_now(tl.state, 1)
        # else: a closure-based step (Lightning): its forward and backward run inside optimizer.step(), after this
        # hook; the gradients it used are fingerprinted when it returns (`_on_optimizer_post`).
        # The settings this step is taken with: ranks whose settings differ update identical replicas differently.
        tl.state.counters.optimizer_digest, settings = describe(opt)
        # The batches the training loader handed out since the last step: ranks that draw different numbers per
        # step (a batch skipped on one rank) run out at different steps.
        drawn, tl.drawn_from = dataloaders.drawn_since(tl.drawn_from)
        tl.state.counters.batches_drawn += drawn
        tl.log.note_step(tl.log.optimizer_log, settings)
        tl.clock.optimizer_start = time.perf_counter()
        tl.phase = Phase.OPTIMIZER

    def _on_optimizer_post(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        tl = self._timeline
        now = time.perf_counter()
        tl.state.t_optimizer += now - max(tl.clock.optimizer_start, tl.clock.backward_end)
        tl.state.counters.optimizer_step = 1
        if tl.state.grad_fp is None:
            # A closure ran the backward inside the step (or there was none): the gradients as the step leaves
            # them, which are those it used unless the optimizer writes them itself (then alike on every rank).
            self._grads_now(tl.state, 2)
        tl.clock.step_end = now
        tl.versions.mark()  # what the optimizer wrote is its own; a write after this, before the next forward, is not
        if tl.inside_forward:
            # Lightning's manual optimization steps inside training_step, which runs inside DDP's forward: one
            # forward is the step (a GAN steps two optimizers in it), closed when the forward returns.
            tl.close_after_forward = True
            self._mark_device(tl)
            return
        step, last = tl.log.steps, tl.max_steps is not None and tl.log.steps + 1 >= tl.max_steps
        if last:
            self._mark_device(tl)  # this close ends the observed steps and reads the clock
        tl.close()
        if not last:
            self._mark_device(tl, step)

    @staticmethod
    def _mark_device(tl: Timeline, step: int | None = None) -> None:
        """The step's end on the GPU's clock, after the doctor's own work on it (its fingerprints: not the GPU
        waiting for data), but before the close that ends the observed steps."""
        if tl.log.device is not None:
            tl.log.device.on_step(tl.log.steps if step is None else step)
