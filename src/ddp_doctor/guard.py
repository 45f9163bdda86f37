"""guard: cheap protection for a whole DDP training run.

Three things go wrong silently in long runs (see `DESIGN.md` §1, seeds 002 and 003), and a guard watches for each:

- *wrapper bypass*: the module inside DDP runs forward in grad mode without DDP's forward around it, so DDP's
  reducer never fires. A forward pre-hook on the inner module sees it at the first such call and names the
  user's file:line. Local: no communication.
- *requires_grad flips* after DDP was built, in both directions. DDP's reducer keeps the set it was built with:
  a param frozen later leaves the step's reduction unfinished (default flags: that step's grads are not
  synchronized, the next forward raises) or keeps being all-reduced (`find_unused_parameters=True`); a param
  unfrozen later is never all-reduced. Checked in DDP's forward pre-hook, so the warning comes before the
  backward pass that would do the damage. Local.
- *replica divergence*: every `every` optimizer steps, a per-tensor fingerprint of every parameter (and of the
  buffers when DDP does not broadcast them) is compared across ranks with one small fixed-shape all_reduce
  (`ddp_doctor.replicas`). The step count is the optimizer's, which is the same on every rank, so every rank
  issues the collective at the same point.

The guard's own code never kills training: an internal error is logged once and turns the guard off (on every
rank, at the next scheduled comparison, so no rank is left waiting in a collective).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor import _log
from ddp_doctor._collective import agree, comm_device, layout_hash
from ddp_doctor._compat import ddp_logging_data, ddp_syncs_buffers, parameters_to_ignore
from ddp_doctor.errors import GuardError, InvalidArgumentError
from ddp_doctor.hookutil import Hook, user_site
from ddp_doctor.replicas import Comparison, Entry, compare_replicas, describe, local_rows, report_failure
from ddp_doctor.report.model import Finding, ParamRef
from ddp_doctor.wrapstate import WRAP_STATE_ATTR, require_ddp, require_process_group

__all__ = ["GUARD_ATTR", "Guard", "guard"]

logger = _log.get_logger(__name__)

GUARD_ATTR = "_ddp_doctor_guard"
"""Set on a guarded DDP instance; `refreeze` uses it to move the guard to the DDP it builds."""

_ON_PROBLEM = ("warn", "raise")
_BYPASS_FIX = ("call the DDP wrapper (loss = loss_fn(ddp_model(x))); if the loss needs other outputs, return them "
               "from forward. When that is impossible, call ddp_doctor.sync_gradients(ddp_model) after backward().")
_REFREEZE_FIX = ("set requires_grad before wrapping; to change the trainable set mid-training, rebuild DDP with "
                 "ddp_model = ddp_doctor.refreeze(ddp_model, optimizer, freeze=..., unfreeze=...).")


def guard(ddp_model: DistributedDataParallel, *, every: int = 100, on_problem: str = "warn",
          optimizer: torch.optim.Optimizer | None = None) -> Guard:
    """Protect a DDP training run: wrapper bypass, requires_grad flips, and periodic replica comparison.

    Call it on every rank right after building DDP (and the optimizer). It is collective once, at creation (the
    ranks check that they guard the same parameter list), and then every `every` optimizer steps.

    Args:
        ddp_model: the `DistributedDataParallel` model the loop trains.
        every: compare the replicas every this many optimizer steps (one all_reduce of ``8 * (tensors + 1)``
            float64 numbers, plus fingerprinting every parameter once).
        on_problem: ``"warn"`` logs each problem once through the ``ddp_doctor.guard`` logger and never stops
            training; ``"raise"`` raises `GuardError` for problems of severity ``error`` (warnings are logged).
        optimizer: the optimizer the loop steps. A step is then one ``optimizer.step()``, which is what
            gradient accumulation needs. Without it, a step is one forward in grad mode that synchronizes
            (a DDP forward outside ``no_sync()``, or a forward that bypasses DDP).

    Returns:
        A `Guard`; use it as a context manager or call `close()` at the end, on every rank.

    Raises:
        NotDDPModelError: `ddp_model` is not a `DistributedDataParallel`.
        ProcessGroupNotInitializedError: `torch.distributed` is not initialized.
        InvalidArgumentError: `every`, `on_problem` or `optimizer` has an unusable value, or the model is
            already guarded.
        RankMismatchError: the ranks guard different parameter lists (raised on every rank).
        GuardError: with ``on_problem="raise"``, `requires_grad` already changed between wrapping and `guard()`.

    Example:
        >>> with ddp_doctor.guard(ddp_model, every=200, optimizer=opt) as g:
        ...     for step, (x, y) in enumerate(loader):
        ...         loss_fn(ddp_model(x), y).backward(); opt.step(); opt.zero_grad()
        ...         if step % 1000 == 0:
        ...             g.before_save()                 # every rank; warns or raises if replicas differ
        ...             if rank == 0: torch.save(ddp_model.module.state_dict(), "ckpt.pt")
    """
    return Guard(ddp_model, every=every, on_problem=on_problem, optimizer=optimizer)


class Guard:
    """The object `guard()` returns. See `guard` for the arguments.

    Attributes:
        problems: every problem found so far, as `ddp_doctor.Finding` objects.
        steps: optimizer steps (or synchronized forwards, without an optimizer) seen so far.
        checks: replica comparisons done so far.
    """

    def __init__(self, ddp_model: DistributedDataParallel, *, every: int = 100, on_problem: str = "warn",
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        require_ddp(ddp_model, "guard()")
        require_process_group("guard()")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidArgumentError(
                f"every must be a positive int (compare the replicas every that many optimizer steps), got "
                f"{every!r}. Try every=100.")
        if on_problem not in _ON_PROBLEM:
            raise InvalidArgumentError(f"on_problem must be 'warn' or 'raise', got {on_problem!r}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__qualname__}.")
        other = getattr(ddp_model, GUARD_ATTR, None)
        if other is not None and other.active:
            raise InvalidArgumentError(
                "this DDP model already has an active guard; close() it before creating another.")

        self.every = every
        self.on_problem = on_problem
        self.problems: list[Finding] = []
        self.steps = 0
        self.checks = 0
        self._ddp = ddp_model
        self._module: torch.nn.Module = ddp_model.module
        self._optimizer = optimizer
        self._group = ddp_model.process_group
        self._rank = dist.get_rank()
        ignore = parameters_to_ignore(ddp_model)
        named = [(n, p) for n, p in self._module.named_parameters() if n not in ignore]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffer_names = [n for n, _ in self._module.named_buffers() if n not in ignore]
        self._device = comm_device(self._group, self._params[0].device if self._params else None)
        self._handles: list[Any] = []
        self._ddp_handles: list[Any] = []
        self._depth = 0
        self._ddp_forwards = 0
        """Grad-mode DDP forwards since the last optimizer step."""
        self._submodules = {id(m) for m in self._module.modules()}
        self._global_handles: list[Any] = []
        self._active = True
        self._broken = False
        self._reported: set[tuple[Any, ...]] = set()
        self._diverged: list[str] = []
        self._check_layout()
        self._wrap_trainable = self._trainable_at_wrap()
        self._attach()
        try:
            # A flip between wrapping and guard() is visible at once when DDP's own tensor count disagrees.
            self._check_wrap_count()
        except GuardError:
            self._detach()
            raise

    # ------------------------------------------------------------------------------------------------ set-up

    def _check_layout(self) -> None:
        described = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in zip(self._names, self._params)]
        described += [f"buffer {n}" for n in self._buffer_names]
        agree([layout_hash(described), len(described)], group=self._group, device=self._device,
              what="guard() found different models on the ranks", cause="names, shapes or dtypes",
              describe=lambda h: f"{int(h[1])} tensors",
              fix="Every rank must build the same model, in the same order, before wrapping it in DDP.")

    def _trainable_at_wrap(self) -> list[bool]:
        state = getattr(self._ddp, WRAP_STATE_ATTR, None)
        if state is not None:
            all_names = [n for n, _ in self._module.named_parameters()]
            if len(state.get("trainable", ())) == len(all_names):
                by_name = dict(zip(all_names, state["trainable"]))
                return [bool(by_name[n]) for n in self._names]
        return [p.requires_grad for p in self._params]

    def _check_wrap_count(self) -> None:
        logging_data = ddp_logging_data(self._ddp)
        if logging_data is None:  # the check is a bonus
            return
        wrap_count = int(logging_data.get("num_parameter_tensors", -1))
        now = sum(self._wrap_trainable)
        if wrap_count < 0 or wrap_count == now:
            return
        frozen = wrap_count > now
        self._report([Finding(
            code="frozen-after-wrap" if frozen else "unfrozen-after-wrap",
            severity="error" if not frozen or not self._ddp.find_unused_parameters else "warning",
            title=f"requires_grad changed between building DDP and guard(): DDP reduces {wrap_count} parameter "
                  f"tensors, {now} require grad now",
            detail="DDP's reducer keeps the trainable set it was built with. The guard cannot name the parameters "
                   "because it started after the change.",
            ranks=[self._rank], steps=[self.steps],
            fix="call guard() right after building DDP; " + _REFREEZE_FIX)])

    def _attach(self) -> None:
        self._attach_ddp()
        self._handles.append(self._module.register_forward_pre_hook(Hook(self._on_module_forward_pre)))
        self._handles.append(self._module.register_state_dict_pre_hook(Hook(self._on_state_dict)))
        if self._optimizer is not None:
            self._handles.append(self._optimizer.register_step_pre_hook(Hook(self._on_optimizer_pre)))
            self._handles.append(self._optimizer.register_step_post_hook(Hook(self._on_optimizer_step)))
        self._arm_site_finder()

    def _arm_site_finder(self) -> None:
        """Global module hooks that see a bypass through any submodule (seed 002 calls a method of the inner
        module that calls its layers, so the inner module's own forward never runs) and name the caller's line.

        A hook on every module call costs about 3% of a CPU step here, so they stay only until the first healthy
        step; after that an O(1) check at each optimizer step notices a bypass within that step.
        """
        if not self._global_handles:
            self._global_handles = [register_module_forward_pre_hook(Hook(self._on_any_module_forward_pre))]

    def _disarm_site_finder(self) -> None:
        for h in self._global_handles:
            h.remove()
        self._global_handles.clear()

    def _attach_ddp(self) -> None:
        self._ddp_handles = [
            self._ddp.register_forward_pre_hook(Hook(self._on_ddp_forward_pre)),
            # always_call: the depth must come back down even when DDP's forward raises.
            self._ddp.register_forward_hook(Hook(self._on_ddp_forward), always_call=True),
        ]
        setattr(self._ddp, GUARD_ATTR, self)

    def _detach(self) -> None:
        self._disarm_site_finder()
        for h in self._handles + self._ddp_handles:
            h.remove()
        self._handles.clear()
        self._ddp_handles.clear()
        if getattr(self._ddp, GUARD_ATTR, None) is self:
            delattr(self._ddp, GUARD_ATTR)
        self._active = False

    def _rebind(self, new_ddp: DistributedDataParallel) -> None:
        """Follow `refreeze`: watch `new_ddp` (same module) and take its trainable set as the wrap-time state."""
        for h in self._ddp_handles:
            h.remove()
        if getattr(self._ddp, GUARD_ATTR, None) is self:
            delattr(self._ddp, GUARD_ATTR)
        self._ddp = new_ddp
        self._depth = 0
        self._wrap_trainable = [p.requires_grad for p in self._params]
        self._reported = {k for k in self._reported if k[0] != "flip"}
        self._attach_ddp()

    # ----------------------------------------------------------------------------------------------- public

    @property
    def active(self) -> bool:
        """False after `close()`, or after the guard turned itself off."""
        return self._active

    def check_now(self) -> list[Finding]:
        """Compare the replicas now. Collective: call it on every rank at the same point.

        Returns:
            The divergence problems found (empty when the replicas are identical, or the guard is off).

        Raises:
            GuardError: with ``on_problem="raise"``, when parameters differ across ranks.
        """
        return self._check("check_now()")

    def before_save(self) -> list[Finding]:
        """Compare the replicas right before a checkpoint is saved. Collective: call it on every rank.

        Call it before the ``if rank == 0:`` that saves. A diverged replica is then never saved silently: with
        ``on_problem="warn"`` the problem is logged at ERROR level, with ``"raise"`` it raises.

        Returns:
            The divergence problems found.

        Raises:
            GuardError: with ``on_problem="raise"``, when parameters differ across ranks.
        """
        return self._check("before_save()")

    def close(self) -> None:
        """Remove every hook. Call it on every rank (a later scheduled comparison would otherwise wait)."""
        if self._active:
            self._detach()

    def __enter__(self) -> Guard:  # noqa: PYI034
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "active" if self._active else "off"
        return (f"Guard({state}, every={self.every}, on_problem={self.on_problem!r}, steps={self.steps}, "
                f"checks={self.checks}, problems={[f.code for f in self.problems]})")

    # ------------------------------------------------------------------------------------------------ hooks

    def _safely(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._active or self._broken:
            return None
        try:
            return fn(*args)
        except GuardError:
            raise
        except Exception as exc:  # noqa: BLE001  (the guard must never take training down)
            self._fail(exc)
            return None

    def _on_ddp_forward_pre(self, _module: torch.nn.Module, _args: Any) -> None:
        self._depth += 1
        if torch.is_grad_enabled():
            self._ddp_forwards += 1
            self._safely(self._check_flips)
            if self._optimizer is None and self._ddp.require_backward_grad_sync:
                self._count_step()

    def _on_ddp_forward(self, _module: torch.nn.Module, _args: Any, _output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._optimizer is None and self._global_handles and torch.is_grad_enabled():
            self._disarm_site_finder()        # a healthy forward: from here the inner module's hook suffices

    def _on_module_forward_pre(self, _module: torch.nn.Module, _args: Any) -> None:
        if self._depth == 0 and torch.is_grad_enabled():
            self._safely(self._on_bypass, user_site())
            if self._optimizer is None:
                self._count_step()

    def _on_any_module_forward_pre(self, module: torch.nn.Module, _args: Any) -> None:
        if self._depth == 0 and id(module) in self._submodules and torch.is_grad_enabled():
            self._safely(self._on_bypass, user_site(self._submodules))

    def _on_optimizer_pre(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._ddp_forwards == 0:
            self._safely(self._check_unsynced_step)

    def _on_optimizer_step(self, _opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self.steps += 1
        if self._ddp_forwards and self._global_handles:
            self._disarm_site_finder()        # a healthy step: from here the O(1) check suffices
        self._ddp_forwards = 0
        if self._active and self.steps % self.every == 0:
            self._check(f"step {self.steps}")

    def _count_step(self) -> None:
        # Without an optimizer a step is a synchronizing forward; compare before the forward that starts step
        # k * every + 1, when the weights are those after k * every updates.
        if self._active and self.steps > 0 and self.steps % self.every == 0:
            self._check(f"step {self.steps}")
        self.steps += 1

    def _on_state_dict(self, *_args: Any, **_kwargs: Any) -> None:
        # Local only (state_dict() usually runs on rank 0 alone, so no collective here): it reports what the last
        # comparison already knows.
        if self._diverged and self._active:
            _log.log_once(logger, logging.ERROR,
                          f"ddp-doctor guard (rank {self._rank}): saving a state_dict while the last comparison "
                          f"found the replicas different ({', '.join(self._diverged[:4])}). Every rank's copy is "
                          "not the same; call guard.before_save() on every rank before saving to see which.")

    # ------------------------------------------------------------------------------------------- detectors

    def _on_bypass(self, site: str | None) -> None:
        key = ("wrapper-bypass", site or "")
        if key in self._reported and self.on_problem == "warn":
            return
        where = f" at {site}" if site else ""
        self._report([Finding(
            code="wrapper-bypass", severity="error",
            title=f"the model inside DDP was called directly{where}, so DDP does not synchronize its gradients",
            detail=f"Rank {self._rank} ran the model inside DistributedDataParallel in grad mode without DDP's "
                   "forward around it (for example loss = ddp_model.module(x), or a method of ddp_model.module "
                   "that calls its layers). DDP's reducer only fires after its own forward, so each rank trains "
                   "its own replica.",
            ranks=[self._rank], steps=[self.steps], fix=_BYPASS_FIX)], key=key)
        self._disarm_site_finder()

    def _check_unsynced_step(self) -> None:
        # No grad-mode DDP forward since the last step, yet gradients to apply: they came from a backward that
        # DDP's reducer never saw. The first trainable parameter with a grad ends the scan, so this is O(1) in
        # the bypass case; in healthy runs it never runs (there was a DDP forward).
        if not any(p.grad is not None for p, t in zip(self._params, self._wrap_trainable) if t):
            return
        if self.on_problem == "warn" and any(k[0] == "wrapper-bypass" for k in self._reported):
            return  # already reported (with its call site when the first call was seen)
        site = user_site()
        key = ("wrapper-bypass", "step")
        self._report([Finding(
            code="wrapper-bypass", severity="error",
            title="the optimizer stepped on gradients that DDP never synchronized"
                  + (f" (optimizer step at {site})" if site else ""),
            detail=f"On rank {self._rank} there was no forward through DistributedDataParallel since the last "
                   "optimizer step, yet the parameters have gradients: the loss was computed through the model "
                   "inside DDP (ddp_model.module or one of its methods), so DDP's reducer never fired and each "
                   "rank trains its own replica.",
            ranks=[self._rank], steps=[self.steps], fix=_BYPASS_FIX)], key=key)

    def _check_flips(self) -> None:
        now = [p.requires_grad for p in self._params]
        if now == self._wrap_trainable:
            return
        frozen = [i for i, (w, n) in enumerate(zip(self._wrap_trainable, now)) if w and not n]
        unfrozen = [i for i, (w, n) in enumerate(zip(self._wrap_trainable, now)) if n and not w]
        findings = []
        if frozen:
            fup = bool(self._ddp.find_unused_parameters)
            findings.append(Finding(
                code="frozen-after-wrap", severity="warning" if fup else "error",
                title=f"{len(frozen)} parameter(s) frozen after DDP was built",
                detail="requires_grad was set to False after DDP was built; DDP's reducer still expects their "
                       "gradients. " + ("With find_unused_parameters=True they are still all-reduced (as zeros) "
                                        "every step, which wastes communication." if fup else
                                        "With these flags this step's reduction never finishes: the gradients "
                                        "of the parameters that share their bucket are not synchronized, and "
                                        "the next forward raises 'Expected to have finished reduction'."),
                params=self._refs(frozen), ranks=[self._rank], steps=[self.steps], fix=_REFREEZE_FIX))
        if unfrozen:
            findings.append(Finding(
                code="unfrozen-after-wrap", severity="error",
                title=f"{len(unfrozen)} parameter(s) unfrozen after DDP was built",
                detail="requires_grad was set to True after DDP was built. DDP's reducer has no hook for them, so "
                       "their gradients are never all-reduced and each rank trains its own copy silently.",
                params=self._refs(unfrozen), ranks=[self._rank], steps=[self.steps], fix=_REFREEZE_FIX))
        self._report(findings, key=("flip", tuple(frozen), tuple(unfrozen)))

    def _entries(self) -> list[Entry]:
        # Buffers are compared only when DDP does not broadcast them in forward: otherwise rank 0's overwrite the
        # others' at the next forward, and BatchNorm statistics legitimately differ after a forward.
        sync_buffers = ddp_syncs_buffers(self._ddp)
        entries = [Entry(n, "param", p.numel(), p) for n, p in zip(self._names, self._params)]
        for n in self._buffer_names:
            try:
                b = None if sync_buffers else self._module.get_buffer(n)
            except AttributeError:
                b = None
            entries.append(Entry(n, "buffer", b.numel() if b is not None else 0, b))
        return entries

    def _check(self, reason: str) -> list[Finding]:
        """The scheduled (or requested) comparison. Collective; every rank reaches it at the same step."""
        if not self._active:
            return []
        entries = self._entries()
        rows = None
        if not self._broken:
            try:
                rows = local_rows(entries)
            except Exception as exc:  # noqa: BLE001  (reported to every rank through the comparison)
                self._fail(exc)
        try:
            if rows is None:
                comparison = report_failure(entries, group=self._group, device=self._device)
            else:
                comparison = compare_replicas(entries, group=self._group, device=self._device, rows=rows)
        except Exception as exc:  # noqa: BLE001  (the collective failed: peers are gone or out of step)
            self._fail(exc)
            self._detach()
            return []
        self.checks += 1
        if comparison.failed_ranks:
            if _log.is_rank_zero() or self._broken:
                logger.warning("ddp-doctor guard: turned off on every rank after an internal error on rank(s) %s; "
                               "training continues unguarded.", comparison.failed_ranks)
            self._detach()
            return []
        try:
            findings = self._divergence_findings(comparison, reason)
        except Exception as exc:  # noqa: BLE001  (same inputs on every rank: every rank turns off here)
            self._fail(exc)
            self._detach()
            return []
        self._diverged = [d.name for d in comparison.of_kind("param")]
        key = ("divergence", tuple(d.name for d in comparison.differences))
        if not comparison.differences:
            self._reported = {k for k in self._reported if k[0] != "divergence"}
        explicit = reason in ("check_now()", "before_save()")
        self._report(findings, key=key, collective=True, explicit=explicit, save=reason == "before_save()")
        return findings

    def _divergence_findings(self, comparison: Comparison, reason: str) -> list[Finding]:
        findings = []
        params = comparison.of_kind("param")
        if params:
            ranks = sorted({r for d in params for r in d.ranks} | {params[0].reference_rank})
            rounding = all(d.rounding_only for d in params)
            findings.append(Finding(
                code="replica-divergence", severity="warning" if rounding else "error",
                title=f"weights of {len(params)} parameter(s) differ across ranks ({reason})",
                detail=f"At {reason} the replicas are no longer identical:\n{describe(params)}\n"
                       "Whatever rank 0 saves is not what the other ranks trained.",
                params=[ParamRef(d.name, d.numel, self._shape(d.name)) for d in params], ranks=ranks,
                steps=[self.steps],
                fix="find the cause (a bypassed wrapper, a requires_grad change after wrapping, rank-dependent "
                    "updates outside DDP); restart from a checkpoint saved before the divergence."))
        buffers = comparison.of_kind("buffer")
        if buffers:
            findings.append(Finding(
                code="buffer-divergence", severity="warning",
                title=f"{len(buffers)} buffer(s) differ across ranks ({reason})",
                detail="DDP was built with broadcast_buffers=False (forward_sync_buffers=False), and these buffers "
                       f"differ:\n{describe(buffers)}\nEvaluation then differs by rank, and only rank 0's are saved.",
                params=[ParamRef(d.name, d.numel) for d in buffers],
                ranks=sorted({r for d in buffers for r in d.ranks} | {buffers[0].reference_rank}),
                steps=[self.steps],
                fix="build DDP with broadcast_buffers=True (the default), or convert BatchNorm with "
                    "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping."))
        return findings

    # ------------------------------------------------------------------------------------------- reporting

    def _refs(self, indices: list[int]) -> list[ParamRef]:
        return [ParamRef(self._names[i], self._params[i].numel(), tuple(self._params[i].shape)) for i in indices]

    def _shape(self, name: str) -> tuple[int, ...]:
        try:
            return tuple(self._params[self._names.index(name)].shape)
        except ValueError:
            return ()

    def _report(self, findings: list[Finding], *, key: Any = None, collective: bool = False,
                explicit: bool = False, save: bool = False) -> None:
        """Record, raise or log `findings`. A problem already reported under `key` is not logged again (a
        diverged run would otherwise log every `every` steps); an explicit check always reports."""
        if not findings:
            return
        repeat = key is not None and key in self._reported and not explicit
        if not repeat:
            if key is not None:
                self._reported.add(key)
            self.problems.extend(findings)
        errors = [f for f in findings if f.severity == "error"]
        if self.on_problem == "raise" and errors:
            raise GuardError("\n".join(_render(f) for f in errors), findings=errors)
        if repeat or (collective and not self._is_first_rank()):
            return  # collective results are identical on every rank; one log line is enough
        for f in findings:
            level = logging.ERROR if save and f.severity == "error" else logging.WARNING
            logger.log(level, "%s", _render(f))

    def _is_first_rank(self) -> bool:
        return dist.get_rank(self._group) == 0

    def _fail(self, exc: BaseException) -> None:
        """An internal error: log once, stop the local detectors; the next comparison turns every rank off."""
        if self._broken:
            return
        self._broken = True
        logger.warning("ddp-doctor guard (rank %d) hit an internal error and turns itself off; training continues "
                       "unguarded: %s: %s", self._rank, type(exc).__name__, exc, exc_info=exc)


def _render(f: Finding) -> str:
    params = ", ".join(str(p) for p in f.params[:6]) + (f" and {len(f.params) - 6} more" if len(f.params) > 6 else "")
    lines = [f"ddp-doctor guard [{f.code}] {f.title}"]
    if params and not all(f"  {p.name} (" in f.detail for p in f.params):   # the detail lists them otherwise
        lines.append(f"  params: {params}")
    lines.append(f"  ranks: {f.ranks}; step: {f.steps}")
    lines.append("  " + f.detail.replace("\n", "\n  "))
    lines.append(f"  fix: {f.fix}")
    return "\n".join(lines)
