"""Wrapper bypass: the module inside DDP runs forward in grad mode without DDP's forward around it, so DDP's
reducer never fires and each rank trains its own replica. Local: no communication.

Two ways to see it. At the call: a forward pre-hook on the inner module, plus global module hooks for the pattern
where the trainer calls a method of the inner module (``ddp_model.module.compute_loss(batch)``) that calls its
layers, so the inner module's own forward never runs. At the optimizer step: no DDP forward since the last step,
yet the parameters have gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ddp_doctor.analyze import rules
from ddp_doctor.core.codes import Code
from ddp_doctor.core.frames import user_site
from ddp_doctor.fixes.guard.problems import Reporter
from ddp_doctor.observation.hooks import Hook

__all__ = ["BYPASS_FIX", "BypassWatch"]

BYPASS_FIX = (
    "call the DDP wrapper (loss = loss_fn(ddp_model(x))); if the loss needs other outputs, return them "
    "from forward. When that is impossible, call ddp_doctor.sync_gradients(ddp_model) after backward()."
)


class BypassWatch:
    """Finds a bypass of the DDP wrapper and names the user's line."""

    def __init__(self, module: torch.nn.Module, reporter: Reporter, rank: int) -> None:
        self.submodules = {id(m) for m in module.modules()}
        """Ids of the inner module and its submodules: a call into any of them outside DDP's forward is a bypass,
        and `user_site` skips their own frames to name the caller's line."""
        self._reporter = reporter
        self._rank = rank
        self._global_handles: list[Any] = []

    @property
    def armed(self) -> bool:
        """True while the global module hooks are registered."""
        return bool(self._global_handles)

    def arm(self, on_any_module_forward_pre: Callable[..., Any]) -> None:
        """Register the global module hook (through `Hook`, so a copied model does not drag the guard along).

        A hook on every module call costs about 3% of a CPU step here, so it stays only until the first healthy
        step; after that the O(1) check at each optimizer step (`unsynced_step`) notices a bypass within that step.
        """
        if not self._global_handles:
            self._global_handles = [register_module_forward_pre_hook(Hook(on_any_module_forward_pre))]

    def disarm(self) -> None:
        for h in self._global_handles:
            h.remove()
        self._global_handles.clear()

    def called_directly(self, site: str | None, step: int) -> None:
        """The inner module (or one of its submodules) ran in grad mode outside DDP's forward, called from `site`."""
        key = (Code.WRAPPER_BYPASS, site or "")
        if self._reporter.seen(key) and self._reporter.on_problem == "warn":
            return
        where = f" at {site}" if site else ""
        self._reporter.report(
            [
                rules.wrapper_bypass(
                    title=f"the model inside DDP was called directly{where}, so DDP does not synchronize its gradients",
                    detail=f"Rank {self._rank} ran the model inside DistributedDataParallel in grad mode without DDP's "
                    "forward around it (for example loss = ddp_model.module(x), or a method of ddp_model.module "
                    "that calls its layers). DDP's reducer only fires after its own forward, so each rank trains "
                    "its own replica.",
                    params=[],
                    ranks=[self._rank],
                    steps=[step],
                    fix=BYPASS_FIX,
                )
            ],
            key=key,
        )
        self.disarm()

    def unsynced_step(self, params: list[torch.nn.Parameter], trainable: list[bool], step: int) -> None:
        """Called at an optimizer step with no grad-mode DDP forward since the last one.

        Gradients to apply then came from a backward that DDP's reducer never saw. The first trainable parameter
        with a grad ends the scan, so this is O(1) in the bypass case; in healthy runs it never runs (there was a
        DDP forward).
        """
        if not any(p.grad is not None for p, t in zip(params, trainable) if t):
            return
        if self._reporter.on_problem == "warn" and self._reporter.seen_kind(Code.WRAPPER_BYPASS):
            return  # already reported (with its call site when the first call was seen)
        site = user_site()
        self._reporter.report(
            [
                rules.wrapper_bypass(
                    title="the optimizer stepped on gradients that DDP never synchronized"
                    + (f" (optimizer step at {site})" if site else ""),
                    detail=f"On rank {self._rank} there was no forward through DistributedDataParallel since the last "
                    "optimizer step, yet the parameters have gradients: the loss was computed through the model "
                    "inside DDP (ddp_model.module or one of its methods), so DDP's reducer never fired and each "
                    "rank trains its own replica.",
                    params=[],
                    ranks=[self._rank],
                    steps=[step],
                    fix=BYPASS_FIX,
                )
            ],
            key=(Code.WRAPPER_BYPASS, "step"),
        )
