"""The observed model as the hooks see it: its parameters by position, and which modules own which."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.compat import is_dtensor
from ddp_doctor.observation.wrapstate import is_local_batchnorm

__all__ = ["WRAPPED", "Target"]

WRAPPED: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
"""Every DDP model a `Target` was made for, and the process's other DDP models once an optimizer stepping none of
the observed model's parameters appears: what another DDP model holds is not beside this one."""


@dataclass(kw_only=True)
class Target:
    """A DDP model and the optimizer that closes its steps."""

    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer | None
    """Given, or adopted at its first step when `auto_optimizer` (None until then)."""
    auto_optimizer: bool
    module: torch.nn.Module = field(init=False)
    names: list[str] = field(init=False)
    params: list[torch.nn.Parameter] = field(init=False)
    buffers: list[torch.Tensor] = field(init=False)
    """The buffers DDP was built with, in `named_buffers()` order."""
    buffer_slots: list[tuple[torch.nn.Module, str]] = field(init=False)
    """Per buffer: the module that holds it and its name there (`current_buffers`)."""
    index: dict[int, int] = field(init=False)
    """`id(parameter)` -> its position."""
    owned: dict[int, list[int]] = field(init=False)
    """`id(module)` -> the positions of the module's own (direct) parameters: a module that runs is evidence its
    parameters are meant to be used."""
    submodules: set[int] = field(init=False)
    synced: list[bool] = field(init=False)
    """Per position: DDP's reducer reduces its gradient (trainable when DDP was built, not ignored)."""
    batchnorm: list[torch.nn.Module] = field(init=False)
    """The BatchNorm layers that normalize over this rank's batch alone (not SyncBatchNorm)."""
    others: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = field(init=False)
    """The other optimizers seen stepping, each with whether it steps none of this model's parameters (a second
    optimizer for a tensor kept beside the model)."""
    registered: list[torch.nn.Parameter] = field(init=False)
    """The parameters DDP's reducer holds, and those it was told to ignore: every other parameter in the module
    tree was created or replaced after DDP was built (`tree_scan.py`)."""

    def __post_init__(self) -> None:
        self.module = self.ddp.module
        WRAPPED.add(self.ddp)
        self.others = weakref.WeakKeyDictionary()
        named = list(self.module.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.buffers, self.buffer_slots, seen = [], [], set()
        for m in self.module.modules():  # named_buffers()'s order: modules, then each one's own, each tensor once
            for name, b in m._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    self.buffers.append(b)
                    self.buffer_slots.append((m, name))
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.submodules = {id(m) for m in self.module.modules()}
        self.batchnorm = [m for m in self.module.modules() if is_local_batchnorm(m)]
        reducer_params = getattr(self.ddp, "_module_parameters", None) or self.params
        ignored = getattr(self.ddp, "parameters_to_ignore", set())
        self.registered = [*reducer_params, *(p for n, p in named if n in ignored)]
        reduced = {id(p) for p in reducer_params}
        self.synced = [id(p) in reduced and p.requires_grad for p in self.params]
        self.owned = {}
        for m in self.module.modules():
            owned = [self.index[id(q)] for q in m.parameters(recurse=False) if id(q) in self.index]
            if owned:
                self.owned[id(m)] = owned

    def current_buffers(self) -> list[torch.Tensor]:
        """The tensors the buffers' names hold now: a buffer reassigned after DDP was built
        (`model.module.scale = torch.rand(8)`) is the one the forward uses, not the one DDP saw."""
        return [
            now if (now := m._buffers.get(name)) is not None else was
            for (m, name), was in zip(self.buffer_slots, self.buffers)
        ]

    def note_other(self, opt: torch.optim.Optimizer, *_hook_args: Any) -> None:
        """`opt` is about to step (a global step pre-hook's call): remember it if it is not the observed one."""
        if opt is not self.optimizer and opt not in self.others:
            self.others[opt] = alone = not self.steps_params(opt)
            if alone:  # its parameters may be another DDP model's, one nobody observes: DDP syncs those
                # (`type(o)`, not isinstance: an object's `__class__` can warn, as torch's deprecated `reduce_op`)
                WRAPPED.update(o for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel))

    def beside(self) -> list[tuple[torch.Tensor, str]]:
        """The trainable tensors that the other optimizers stepping none of this model's parameters step, that no DDP
        model holds and that are not DTensors (sharded or laid out by FSDP2 or tensor parallelism), each with its
        place (`param_groups[0]['params'][1] of Adam`)."""
        apart = [opt for opt, alone in list(self.others.items()) if alone]
        if not apart:
            return []
        candidates = [
            (p, f"param_groups[{g}]['params'][{i}] of {type(opt).__name__}")
            for opt in apart
            for g, group in enumerate(opt.param_groups)
            for i, p in enumerate(group["params"])
            if p.requires_grad and not is_dtensor(p)  # a DTensor's shards differ by design: FSDP2's, TP's
        ]
        if not candidates:
            return []
        wrapped = {id(p) for ddp in list(WRAPPED) for p in ddp.module.parameters()}
        return [(p, where) for p, where in candidates if id(p) not in wrapped]

    def steps_params(self, opt: torch.optim.Optimizer) -> bool:
        """Whether `opt` updates any of the model's parameters."""
        return any(id(p) in self.index for g in opt.param_groups for p in g["params"])
