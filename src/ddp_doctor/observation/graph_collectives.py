"""Collectives the script runs in place on a tensor autograd tracks, and the gradient a backward sent through them.

`dist.all_reduce(loss)` before `loss.backward()` ("average the loss across ranks for logging") looks harmless, but the
c10d collectives have no autograd formula: backward passes through them as if they were not there (torch warns once,
"an autograd kernel was not registered ... silently incorrect behavior"). The gradient each rank computes is then its
own loss's, times whatever the script did to the reduced value afterwards: `loss /= world_size` after a SUM makes
every gradient `world_size` times smaller than DDP's average of the ranks' own. A hook on the reduced tensor measures
that factor when a backward goes through it (`scale`: the gradient arriving there, 1/world_size for that division);
a reduction after the backward, or of a detached copy, never fires it and is not kept. Only scalars are watched:
an activation all-reduced in the forward (tensor parallelism's row-parallel layer) rightly passes its gradient
through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.core.frames import user_site_of
from ddp_doctor.observation import gradscaler
from ddp_doctor.observation.collectives import Call

__all__ = ["GraphCollectives"]

_REDUCTIONS = ("all_reduce", "reduce")
"""The in-place reductions whose result a script goes on computing with."""
MAX_SITES = 4


class GraphCollectives:
    """The script's in-place reductions of tensors in the autograd graph that a backward went through.

    Args:
        step: the observed step in progress (a callable: the count of closed steps).
    """

    def __init__(self, step: Callable[[], int]) -> None:
        self._step = step
        self._sites: dict[str, dict[str, Any]] = {}

    @property
    def found(self) -> list[dict[str, Any]]:
        """Per line of the script, the first time a backward went through it: `call` (`all_reduce(float32[])`),
        `reduce_op` (`SUM` when none was passed), `group_size`, `site`, `step`, `scale` (the mean gradient that
        arrived at the reduced tensor over a GradScaler's `loss_scale`, 1 without one: the factor the script applied
        to it before the backward)."""
        return [dict(e) for e in self._sites.values() if e["scale"] is not None]

    def note(self, call: Call) -> None:
        """The script entered `call` (a listener of `observation/collectives.py` passes it on)."""
        t = call.first
        # A scalar only (a loss): an activation reduced in place in the forward (a row-parallel layer's all_reduce)
        # rightly passes its gradient through unchanged, and has no single factor.
        if call.op not in _REDUCTIONS or t is None or t.grad_fn is None or not t.requires_grad or t.numel() != 1:
            return
        site = user_site_of(call.caller, None) or "an unknown place"
        entry = self._sites.get(site)
        if entry is None:
            if len(self._sites) >= MAX_SITES:
                return
            entry = self._sites[site] = {
                "call": call.describe(),
                "reduce_op": call.reduce_op or "SUM",
                "group_size": call.group_size,
                "site": site,
                "step": None,
                "scale": None,
            }
        if entry["scale"] is None:  # one hook per call until a backward has gone through one
            t.register_hook(self._through(entry, self._step(), gradscaler.scaled()[0]))

    @staticmethod
    def _through(entry: dict[str, Any], step: int, scaler_calls: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if entry["scale"] is None:
                # A GradScaler that scaled a loss since the reduction multiplied this gradient by its loss scale,
                # which it divides out before the step: the script's own factor is what is left.
                calls, loss_scale = gradscaler.scaled()
                divide = float(loss_scale) if calls > scaler_calls and loss_scale is not None else 1.0
                entry["scale"], entry["step"] = float(grad.detach().double().mean()) / divide, step
                entry["loss_scale"] = divide

        return hook
