"""Rebuild the script's own DDP object in place, and put its model and optimizer back to a saved starting point:
what lets `ddp-doctor bench` run every candidate in one launch (`inrank.py`)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import Optimizer

from ddp_doctor.bench.candidates import Config
from ddp_doctor.core.errors import DoctorError
from ddp_doctor.doctor import Doctor
from ddp_doctor.observation.wrapstate import WRAP_STATE_ATTR, constructor_kwargs, freeze_named

__all__ = ["Snapshot", "rebuild_in_place", "why_not_shared"]

logger = logging.getLogger(__name__)

_HOOK_DICTS = (
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
"""nn.Module.__init__ replaces these; hooks the script put on its DDP object must survive the rebuild."""


def rebuild_in_place(
    ddp: DistributedDataParallel,
    base_kwargs: dict[str, Any],
    config: Config,
    trainable: list[bool],
    original_init: Callable[..., None] | None = None,
) -> list[bool]:
    """Re-run DDP's constructor on the same object, around the same module, with `config`'s arguments.

    The script holds `ddp` (and its optimizer holds the module's parameters), so the object must stay the same:
    its old reducer's autograd hooks are removed, `__init__` builds a new reducer, and the hooks the script had
    registered on the wrapper, its train/eval mode and its Python comm hooks are carried over. `trainable` is the
    script's own `requires_grad` before any freezing; `config.freeze_before_wrap` is applied on top, before the
    constructor runs, as a user who froze before wrapping would. DDP's constructor broadcasts rank 0's parameters
    and buffers, as at the script's own construction.

    Returns:
        The `requires_grad` flags the new reducer was built with.
    """
    module = ddp.module
    named = list(module.named_parameters())
    for (_, p), t in zip(named, trainable):
        p.requires_grad_(t)
    freeze_named(module, config.freeze_before_wrap, what="the candidate's freeze_before_wrap")
    flags = [p.requires_grad for _, p in named]
    for _, p in named:
        p.grad = None  # a grad that is a view into the old reducer's bucket must not outlive it
    kwargs = {**base_kwargs, **config.ddp_kwargs}
    kwargs.pop("init_sync", None)
    if "bucket_cap_mb" in config.ddp_kwargs:
        kwargs.pop("bucket_cap_mb_list", None)
    hooks = {name: ddp.__dict__[name] for name in _HOOK_DICTS if name in ddp.__dict__}
    comm_hooks = list(getattr(ddp, "_comm_hooks", []))
    training, state = ddp.training, getattr(ddp, WRAP_STATE_ATTR, None)
    try:
        ddp._remove_autograd_hooks()
    except Exception as exc:  # noqa: BLE001  (private API; the old reducer's destructor removes them too)
        logger.debug("could not remove the old reducer's hooks: %s", exc)
    (original_init or DistributedDataParallel.__init__)(ddp, module, **kwargs)
    ddp.__dict__.update(hooks)
    ddp.training = training
    for hook, hook_state in comm_hooks:
        ddp.register_comm_hook(hook_state, hook)
    if state is not None:
        setattr(ddp, WRAP_STATE_ATTR, {**state, "trainable": flags})
    return flags


@dataclass(kw_only=True)
class Snapshot:
    """The model and optimizer state just before the script's first optimizer step, on the CPU."""

    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    state: dict[torch.Tensor, dict[str, Any]]
    """Optimizer state per parameter: tensors as (CPU copy, device)."""
    groups: list[dict[str, Any]]
    """Optimizer param_group settings (lr, betas, ...) without the parameters."""

    @classmethod
    def take(cls, module: torch.nn.Module, opt: Optimizer) -> Snapshot:
        def keep(v: Any) -> Any:
            return (v.detach().to("cpu", copy=True), v.device) if isinstance(v, torch.Tensor) else copy.deepcopy(v)

        return cls(
            params=[p.detach().to("cpu", copy=True) for p in module.parameters()],
            buffers=[b.detach().to("cpu", copy=True) for b in module.buffers()],
            state={p: {k: keep(v) for k, v in s.items()} for p, s in opt.state.items()},
            groups=[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
        )

    def restore(self, module: torch.nn.Module, opt: Optimizer) -> None:
        def back(v: Any) -> Any:
            return (
                v[0].to(v[1], copy=True)
                if isinstance(v, tuple) and isinstance(v[0], torch.Tensor)
                else copy.deepcopy(v)
            )

        with torch.no_grad():
            for p, saved in zip(module.parameters(), self.params):
                p.copy_(saved)
            for b, saved in zip(module.buffers(), self.buffers):
                b.copy_(saved)
        opt.state.clear()
        for p, s in self.state.items():
            opt.state[p] = {k: back(v) for k, v in s.items()}
        for group, saved in zip(opt.param_groups, self.groups):
            group.update(copy.deepcopy(saved))  # in place: a scheduler holds these dicts


def why_not_shared(
    doctors: list[Doctor],
    ddp: DistributedDataParallel | None,
    optimizer: Optimizer | None,
    snapshot: Snapshot | None,
    snapshot_error: str,
) -> tuple[str, dict[str, Any]]:
    """Why the candidates cannot share this launch ("" when they can), and the script's DDP arguments to rebuild
    its wrapper from when they can."""
    if len(doctors) != 1:
        return (
            f"the script builds {len(doctors)} DDP models; the bench rebuilds one wrapper in place, so "
            "each candidate needs a launch of its own"
        ), {}
    if ddp is None or doctors[0].ddp is not ddp or optimizer is None:
        return "the optimizer that trains the DDP model was not found before the first step", {}
    if snapshot is None:
        return snapshot_error or "the model state could not be copied before the first step", {}
    try:
        return "", constructor_kwargs(ddp)
    except DoctorError as exc:
        return f"DDP cannot be rebuilt in place: {exc}", {}
