"""requires_grad flips after DDP was built, in both directions. Local: no communication.

DDP's reducer keeps the trainable set it was built with. A parameter frozen later leaves the step's reduction
unfinished with default flags (that step's grads are not synchronized, the next forward raises) or keeps being
all-reduced (`find_unused_parameters=True`); a parameter unfrozen later is never all-reduced. The guard compares
the flags with the wrap-time state in DDP's forward pre-hook, so the warning comes before the backward pass that
would do the damage. The wrap-time state is `ddp_doctor.observation.wrapstate.model_info`'s, the same one `observe` uses.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.analyze import rules
from ddp_doctor.core.findings import Finding, ParamRef
from ddp_doctor.fixes.guard.problems import Reporter
from ddp_doctor.observation.wrapstate import model_info

__all__ = ["REFREEZE_FIX", "FlipWatch"]

REFREEZE_FIX = (
    "set requires_grad before wrapping; to change the trainable set mid-training, rebuild DDP with "
    "ddp_model = ddp_doctor.refreeze(ddp_model, optimizer, freeze=..., unfreeze=...)."
)
_NOTE = " The guard saw the change when DDP's forward started, before the backward pass it affects."


class FlipWatch:
    """Compares `requires_grad` with the state DDP was built with."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        names: list[str],
        params: list[torch.nn.Parameter],
        reporter: Reporter,
        rank: int,
    ) -> None:
        self._ddp = ddp
        self._names = names
        self._params = params
        self._reporter = reporter
        self._rank = rank
        named = list(ddp.module.named_parameters())
        info = model_info(ddp, named, [b for _, b in ddp.module.named_buffers()])
        at_wrap = {n: t for (n, _), t in zip(named, info.trainable_at_wrap)}
        self.wrap_trainable = [bool(at_wrap[n]) for n in names]
        """Per guarded parameter: did it require grad when DDP was built?"""
        self._exact = info.wrap_state_exact
        self._wrap_count = info.wrap_trainable_count

    def check_start(self, step: int) -> None:
        """At `guard()`: report a flip between building DDP and guarding it.

        Named when the wrap-time state is known (the launcher stamped it, or DDP's recorded tensor count and bytes
        identify the frozen parameters); otherwise DDP's own tensor count tells that something changed.
        """
        now = sum(self.wrap_trainable)
        if not self._exact and self._wrap_count is not None and self._wrap_count != now:
            frozen = self._wrap_count > now
            f = (
                rules.frozen_after_wrap(
                    params=[],
                    ranks=[self._rank],
                    steps=[step],
                    fix="",
                    find_unused=bool(self._ddp.find_unused_parameters),
                    static_graph=bool(self._ddp.static_graph),
                    after_first_step=step > 0,
                )
                if frozen
                else rules.unfrozen_after_wrap(params=[], ranks=[self._rank], steps=[step], fix="")
            )
            self._reporter.report(
                [
                    dataclasses.replace(
                        f,
                        title=f"requires_grad changed between building DDP and guard(): DDP reduces {self._wrap_count} "
                        f"parameter tensors, {now} require grad now",
                        detail="DDP's reducer keeps the trainable set it was built with. The guard cannot name the "
                        "parameters because it started after the change.",
                        fix="call guard() right after building DDP; " + REFREEZE_FIX,
                    )
                ]
            )
        self.check(step)

    def check(self, step: int) -> None:
        """Report the parameters whose `requires_grad` differs from the wrap-time state (once per distinct change)."""
        now = [p.requires_grad for p in self._params]
        if now == self.wrap_trainable:
            return
        frozen = [i for i, (w, n) in enumerate(zip(self.wrap_trainable, now)) if w and not n]
        unfrozen = [i for i, (w, n) in enumerate(zip(self.wrap_trainable, now)) if n and not w]
        findings: list[Finding] = []
        if frozen:
            findings.append(
                rules.frozen_after_wrap(
                    params=self._refs(frozen),
                    ranks=[self._rank],
                    steps=[step],
                    note=_NOTE,
                    fix=REFREEZE_FIX,
                    find_unused=bool(self._ddp.find_unused_parameters),
                    static_graph=bool(self._ddp.static_graph),
                    after_first_step=step > 0,
                )
            )
        if unfrozen:
            findings.append(
                rules.unfrozen_after_wrap(
                    params=self._refs(unfrozen), ranks=[self._rank], steps=[step], note=_NOTE, fix=REFREEZE_FIX
                )
            )
        self._reporter.report(findings, key=("flip", tuple(frozen), tuple(unfrozen)))

    def follow(self, ddp: DistributedDataParallel) -> None:
        """`ddp` now wraps the module, built for the flags the parameters have now: that is the new wrap-time state."""
        self._ddp = ddp
        self.wrap_trainable = [p.requires_grad for p in self._params]
        self._exact = True
        self._reporter.forget("flip")

    def _refs(self, indices: list[int]) -> list[ParamRef]:
        return [ParamRef(self._names[i], self._params[i].numel(), tuple(self._params[i].shape)) for i in indices]
