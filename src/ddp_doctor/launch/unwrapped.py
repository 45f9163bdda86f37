"""In a `check` run whose script builds no DDP model: watch the optimizer that trains on several ranks anyway.

A well-known pattern: the script wraps the model in DDP only on its GPU branch, so on CPU every rank trains its own
copy. The first optimizer that steps while a process group of several ranks exists is followed for K steps (or to
the end of the script); then every rank compares its parameters' fingerprints with one fixed-shape all_reduce and
the report says `model-not-wrapped`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_doctor.analyze.not_wrapped import unwrapped_findings
from ddp_doctor.core.findings import ParamRef, Recommendation, Timing
from ddp_doctor.core.frames import user_site
from ddp_doctor.exchange.primitives import comm_device, minmax
from ddp_doctor.observation.fingerprint import fingerprints
from ddp_doctor.report.model import Report

__all__ = ["PlainOptimizerWatch", "record_creation_site"]

SITE_ATTR = "_ddp_doctor_site"


def record_creation_site(optimizer: torch.optim.Optimizer) -> None:
    """Remember where the script created `optimizer` (called from a wrapper of `Optimizer.__init__`)."""
    if getattr(optimizer, SITE_ATTR, None) is None:
        setattr(optimizer, SITE_ATTR, user_site())


class PlainOptimizerWatch:
    """The first optimizer stepping on a multi-rank group with no DDP model, and its step count."""

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self.names: dict[int, str] = {}
        self.module = ""

    def on_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Count a step; returns True when it was this watch's optimizer."""
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return False
        if self.optimizer is None:
            self.optimizer = optimizer
            self._name_params(sys._getframe(2))
        if optimizer is not self.optimizer:
            return False
        self.steps += 1
        return True

    def _name_params(self, frame: Any) -> None:
        """Names from the module (a local or global of the script) that owns the most of the optimizer's params."""
        wanted = {id(p) for p in self._params()}
        best: tuple[int, str, nn.Module | None] = (0, "", None)
        while frame is not None:
            for value in (*frame.f_locals.values(), *frame.f_globals.values()):
                if isinstance(value, nn.Module):
                    n = sum(id(p) in wanted for p in value.parameters())
                    if n > best[0]:
                        best = (n, type(value).__qualname__, value)
            frame = frame.f_back
        if best[2] is not None:
            self.names = {id(p): n for n, p in best[2].named_parameters()}
            self.module = best[1]

    def _params(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def report(self) -> Report:
        """Compare the parameters across ranks and build the report. Collective: every rank calls it."""
        from ddp_doctor.core import VERSION as __version__

        params = self._params()
        device = comm_device(None, params[0].device if params else None)
        top, low = minmax(torch.tensor([float(len(params))]), None, device)
        refs = [ParamRef(self.names.get(id(p), f"param[{i}]"), p.numel(), tuple(p.shape)) for i, p in enumerate(params)]
        world = dist.get_world_size()
        if top.item() != low.item():
            differ, gap = torch.ones(len(params), dtype=torch.bool), torch.full((len(params),), float("inf"))
        else:
            fp = fingerprints(params).nan_to_num(0.0)
            high, lowest = minmax(fp, None, device)
            differ = (high != lowest).any(-1)
            gap = (high - lowest).abs().amax(-1)
        assert self.optimizer is not None
        findings = unwrapped_findings(
            refs,
            differ,
            gap,
            world=world,
            steps=self.steps,
            optimizer_site=getattr(self.optimizer, SITE_ATTR, None),
            optimizer=type(self.optimizer).__qualname__,
        )
        return Report(
            tool_version=__version__,
            torch_version=torch.__version__,
            backend=str(dist.get_backend()),
            world_size=world,
            steps_observed=self.steps,
            ddp_config={},
            findings=findings,
            recommendation=Recommendation.unknown(
                "No DDP model was built, so there are no DDP flags to recommend: wrap the model first, then "
                "run the check again."
            ),
            timing=Timing(),
            framework="torch",
            ddp_site=None,
        )
