"""guard: cheap protection for a whole DDP training run (the public `guard()` and `Guard`).

Three things go wrong silently in long runs, and a guard watches for each:

- *wrapper bypass* (`bypass`): the module inside DDP runs forward in grad mode without DDP's forward around it,
  so DDP's reducer never fires. A forward pre-hook on the inner module sees it at the first such call and names
  the user's file:line. Local: no communication.
- *requires_grad flips* after DDP was built, in both directions (`flips`). DDP's reducer keeps the set it was
  built with: a param frozen later leaves the step's reduction unfinished (default flags: that step's grads are
  not synchronized, the next forward raises) or keeps being all-reduced (`find_unused_parameters=True`); a param
  unfrozen later is never all-reduced. Checked in DDP's forward pre-hook, so the warning comes before the
  backward pass that would do the damage. Local.
- *replica divergence* (`compare`): every `every` optimizer steps, a per-tensor fingerprint of every parameter
  (and of the buffers when DDP does not broadcast them) is compared across ranks with one small fixed-shape
  all_reduce (`ddp_doctor.exchange.replicas`). The step count is the optimizer's, which is the same on every rank, so
  every rank issues the collective at the same point.

The findings are built by `ddp_doctor.analyze.rules`, the builders `analyze` uses, so a guard and a report agree on
each problem's severity. The guard's own code never kills training: an internal error is logged once and turns
the guard off (on every rank, at the next scheduled comparison, so no rank is left waiting in a collective).
"""

from __future__ import annotations

import logging
from types import TracebackType

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core import log as _log
from ddp_doctor.core.compat import parameters_to_ignore
from ddp_doctor.core.errors import GuardError, InvalidArgumentError
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import named_ranks
from ddp_doctor.exchange.primitives import agree, comm_device, layout_hash
from ddp_doctor.fixes.guard.bypass import BypassWatch
from ddp_doctor.fixes.guard.compare import EXPLICIT, ReplicaCheck
from ddp_doctor.fixes.guard.flips import FlipWatch
from ddp_doctor.fixes.guard.inputs import DataWatch
from ddp_doctor.fixes.guard.problems import LOGGER_NAME, Reporter
from ddp_doctor.fixes.guard.wiring import Hooks
from ddp_doctor.observation.wrapstate import require_ddp, require_process_group

__all__ = ["GUARD_ATTR", "Guard", "guard"]

logger = logging.getLogger(LOGGER_NAME)

GUARD_ATTR = "_ddp_doctor_guard"
"""Set on a guarded DDP instance; `refreeze` reads it to hand the guard over (`Guard.follow`) to the DDP it builds."""

_ON_PROBLEM = ("warn", "raise")


def guard(
    ddp_model: DistributedDataParallel,
    *,
    every: int = 100,
    on_problem: str = "warn",
    optimizer: torch.optim.Optimizer | None = None,
) -> Guard:
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

    def __init__(
        self,
        ddp_model: DistributedDataParallel,
        *,
        every: int = 100,
        on_problem: str = "warn",
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        require_ddp(ddp_model, "guard()")
        require_process_group("guard()")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidArgumentError(
                f"every must be a positive int (compare the replicas every that many optimizer steps), got "
                f"{every!r}. Try every=100."
            )
        if on_problem not in _ON_PROBLEM:
            raise InvalidArgumentError(f"on_problem must be 'warn' or 'raise', got {on_problem!r}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__qualname__}."
            )
        other = getattr(ddp_model, GUARD_ATTR, None)
        if other is not None and other.active:
            raise InvalidArgumentError(
                "this DDP model already has an active guard; close() it before creating another."
            )

        self.every = every
        self.on_problem = on_problem
        self.steps = 0
        self.checks = 0
        self._ddp = ddp_model
        self._module: torch.nn.Module = ddp_model.module
        self._optimizer = optimizer
        self._group = ddp_model.process_group
        self._rank = dist.get_rank()
        ignore = parameters_to_ignore(ddp_model)
        named = [(n, p) for n, p in self._module.named_parameters() if n not in ignore]
        names = [n for n, _ in named]
        self._params = [p for _, p in named]
        buffer_names = [n for n, _ in self._module.named_buffers() if n not in ignore]
        self._device = comm_device(self._group, self._params[0].device if self._params else None)
        self._active = True
        described = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named] + [f"buffer {n}" for n in buffer_names]
        agree(
            [layout_hash(described), len(described)],
            group=self._group,
            device=self._device,
            what="guard() found different models on the ranks",
            cause="names, shapes or dtypes",
            describe=lambda h: f"{int(h[1])} tensors",
            fix="Every rank must build the same model, in the same order, before wrapping it in DDP.",
        )
        self._reporter = Reporter(on_problem=on_problem, group=self._group)
        self._bypass = BypassWatch(self._module, self._reporter, self._rank)
        self._flips = FlipWatch(ddp_model, names, self._params, self._reporter, self._rank)
        self._data = DataWatch(self._reporter, self._rank)
        self._replicas = ReplicaCheck(
            ddp_model, names, self._params, buffer_names, self._group, self._device, self._data
        )
        self._hooks = Hooks(
            self,
            bypass=self._bypass,
            flips=self._flips,
            replicas=self._replicas,
            reporter=self._reporter,
            params=self._params,
            rank=self._rank,
            check=self._check,
        )
        self._hooks.attach(ddp_model, self._module, optimizer)
        setattr(ddp_model, GUARD_ATTR, self)
        try:
            self._flips.check_start(self.steps)  # a flip between wrapping and guard() is visible at once
        except GuardError:
            self._detach()
            raise
        except Exception as exc:  # noqa: BLE001  (the guard must never take training down)
            self._reporter.fail(exc)

    # ----------------------------------------------------------------------------------------------- public

    @property
    def active(self) -> bool:
        """False after `close()`, or after the guard turned itself off."""
        return self._active

    @property
    def problems(self) -> list[Finding]:
        """Every problem found so far, as `ddp_doctor.Finding` objects."""
        return self._reporter.found

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

    def follow(self, ddp_model: DistributedDataParallel) -> None:
        """Hand this guard over to a new DDP built over the same module, and stop watching the old one.

        `ddp_doctor.refreeze` calls it for you. Call it yourself when you rebuild DDP by hand (same module, same
        process group, on every rank). The new DDP's trainable set becomes the wrap-time state, so the
        `requires_grad` changes it was built for are not reported; the step count, the comparison schedule and
        the problems found so far carry over.

        Args:
            ddp_model: the new `DistributedDataParallel`; its ``.module`` must be the guarded module.

        Raises:
            NotDDPModelError: `ddp_model` is not a `DistributedDataParallel`.
            InvalidArgumentError: `ddp_model` wraps another module, or this guard is off (closed, or turned off
                after an internal error).

        Example:
            >>> ddp_model = DistributedDataParallel(ddp_model.module, find_unused_parameters=True)
            >>> g.follow(ddp_model)
        """
        require_ddp(ddp_model, "Guard.follow()")
        if ddp_model.module is not self._module:
            raise InvalidArgumentError(
                f"Guard.follow() needs a DDP over the guarded module ({type(self._module).__qualname__} at "
                f"{id(self._module):#x}), got one over {type(ddp_model.module).__qualname__} at "
                f"{id(ddp_model.module):#x}. Guard a DDP over another module with ddp_doctor.guard(ddp_model)."
            )
        if not self._active:
            raise InvalidArgumentError(
                "Guard.follow() was called on a guard that is off (closed, or turned off after an internal "
                "error); create a new one with ddp_doctor.guard(ddp_model)."
            )
        self._hooks.detach_ddp()
        if getattr(self._ddp, GUARD_ATTR, None) is self:
            delattr(self._ddp, GUARD_ATTR)
        self._ddp = ddp_model
        self._flips.follow(ddp_model)
        self._replicas.follow(ddp_model)
        self._hooks.attach_ddp(ddp_model)
        setattr(ddp_model, GUARD_ATTR, self)

    def close(self) -> None:
        """Remove every hook. Call it on every rank (a later scheduled comparison would otherwise wait)."""
        if self._active:
            self._detach()

    def __enter__(self) -> Guard:  # noqa: PYI034
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "active" if self._active else "off"
        return (
            f"Guard({state}, every={self.every}, on_problem={self.on_problem!r}, steps={self.steps}, "
            f"checks={self.checks}, problems={[f.code for f in self.problems]})"
        )

    # ------------------------------------------------------------------------------------------------ private

    def _detach(self) -> None:
        self._hooks.detach()
        self._data.close()
        if getattr(self._ddp, GUARD_ATTR, None) is self:
            delattr(self._ddp, GUARD_ATTR)
        self._active = False

    def _check(self, reason: str) -> list[Finding]:
        """The scheduled (or requested) comparison. Collective; every rank reaches it at the same step."""
        if not self._active:
            return []
        comparison = self._replicas.run(self._reporter)
        if comparison is None:
            self._detach()
            return []
        self.checks += 1
        if comparison.failed_ranks:
            if _log.is_rank_zero() or self._reporter.broken:
                logger.warning(
                    "ddp-doctor guard: turned off on every rank after an internal error on %s; "
                    "training continues unguarded.",
                    named_ranks(comparison.failed_ranks, comparison.more_failed),
                )
            self._detach()
            return []
        try:
            findings = self._replicas.findings(comparison, reason, self.steps)
        except Exception as exc:  # noqa: BLE001  (same inputs on every rank: every rank turns off here)
            self._reporter.fail(exc)
            self._detach()
            return []
        if not comparison.differences:
            self._reporter.forget("divergence")
        self._reporter.report(
            findings,
            key=("divergence", tuple(d.name for d in comparison.differences)),
            collective=True,
            explicit=reason in EXPLICIT,
            save=reason == "before_save()",
        )
        return findings
