"""What the model holds at each step, found by walking its module tree then, not from the list DDP made at wrap.

DDP's reducer synchronizes the parameters it registered when it was built, and compares nothing else. A parameter
created or replaced after that (`model.module.head = nn.Linear(...)`, `register_parameter` in a later step) sits in
the module tree, the forward uses it and the optimizer may step it, but each rank trains it from its own gradient:
the replicas part, silently. A module put in eval mode on some ranks only changes what forward computes there.

`StateScan` walks the tree when each observed step closes (a few microseconds per module, no tensor copied): every
module's `training` flag, every parameter DDP's reducer does not hold, with its fingerprint and `requires_grad`. The
step's counters get a digest of it (`state_digest`: equal on ranks whose replicas hold the same such state) and the
count of trainable parameters DDP does not know (`unregistered`); a log entry names them when the state changes. Global registration hooks (torch's
`register_module_*_registration_hook`, while observing) remember the user's line that attached a parameter or module
to the tree after DDP was built, so the report can name where it was created.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ddp_doctor.core.counters import StepCounters
from ddp_doctor.core.fingerprint import fingerprints, holds_data, readable
from ddp_doctor.core.frames import user_site, variable_names
from ddp_doctor.observation.beside_modules import BesideModules
from ddp_doctor.observation.module_calls import CAST_SITES

__all__ = ["MAX_STATE_LOG", "StateScan", "modes_of"]

MAX_STATE_LOG = 16
"""At most this many entries of the state log (one per change of the rank's state)."""
_MAX_NAMED = 8
"""Names listed per kind in one entry."""
_MAX_SITES = 256


def modes_of(module: nn.Module) -> tuple[int, dict[str, Any]]:
    """(digest, entry) of the train/eval modes of `module`'s tree and of its parameters' `requires_grad`: the digest
    covers every module's flag and every parameter's, the entry is the state log's (`training`, the root's mode;
    `other_mode`, at most 8 modules in the other mode, and `other_mode_count`), with `frozen`, at most 8 parameters
    that do not require a gradient, their `frozen_numels`, and `frozen_count`."""
    crc = 0
    other: list[str] = []
    count = 0
    for path, m in module.named_modules(remove_duplicate=False):
        crc = zlib.crc32(b"%s:%d;" % (path.encode(), m.training), crc)
        if m.training != module.training:
            count += 1
            if len(other) < _MAX_NAMED:
                other.append(path)
    frozen = [(name, p.numel()) for name, p in module.named_parameters() if not p.requires_grad]
    crc = zlib.crc32(("frozen:" + ",".join(n for n, _ in frozen)).encode(), crc)
    entry = {"training": module.training, "other_mode": other, "other_mode_count": count}
    named = {"frozen": [n for n, _ in frozen[:_MAX_NAMED]], "frozen_numels": [k for _, k in frozen[:_MAX_NAMED]]}
    return crc & 0x7FFFFFFF, {**entry, **named, "frozen_count": len(frozen)}


class StateScan:
    """The module tree of the observed model at each step, against what DDP registered.

    Args:
        module: the module DDP wraps (`ddp.module`).
        registered: the parameters DDP's reducer holds (or deliberately ignores), by identity.
        optimizer: called for the observed optimizer (None: not known yet).
    """

    def __init__(
        self,
        module: nn.Module,
        registered: list[torch.Tensor],
        positions: list[torch.Tensor],
        optimizer: Callable[[], Any] | None = None,
        *,
        buffer_slots: list[tuple[nn.Module, str]] = (),
        broadcast_buffers: bool = True,
        beside: Callable[[], list[tuple[torch.Tensor, str]]] | None = None,
    ) -> None:
        self._module = module
        self._beside = beside
        """The tensors other optimizers step beside the model (`Target.beside`), with their places."""
        self._slots = {(id(m), name) for m, name in buffer_slots}
        """Where the buffers DDP was built with live (a module and a name): the others were registered after."""
        self._late_buffers = not broadcast_buffers
        """DDP does not broadcast buffers (broadcast_buffers=False, or the model had none when DDP was built: DDP
        then never syncs any, not even ones registered later): one registered after the wrap stays each rank's own."""
        self._late_fp: dict[str, tuple[float, float]] = {}
        """Each such buffer's fingerprint at the first step it was seen."""
        self._late_moved: set[str] = set()
        self._registered = {id(p) for p in registered}
        self._positions = list(positions)
        self._names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        """Each parameter's name in the tree as DDP found it (a weight re-tied after the wrap is named by both)."""
        self._optimizer = optimizer
        self._kinds = [(p.dtype, p.device) for p in self._positions]
        """Each registered parameter's dtype and device when DDP was built."""
        self._casts_before = len(CAST_SITES)
        self._tree = {id(m) for m in module.modules()}
        self.beside_modules = BesideModules(self._tree)
        """The modules the script calls outside DDP's forward (a teacher): their state joins the digest."""
        self._sites: dict[tuple[int, str], str] = {}
        self._removers: list[Any] = []
        self._last: dict[str, Any] = {}
        self.log: list[dict[str, Any]] = []
        """Whenever the rank's state changed: `step`, `training` (the root module's mode), `other_mode` (modules in
        the other mode, at most 8 named; `other_mode_count`), `unregistered` (trainable parameters DDP does not
        hold, at most 8 named)."""
        self.unregistered: list[dict[str, Any]] = []
        """The trainable parameters DDP does not hold, at the last step: `name`, `shape`, `site` (where they were
        attached to the tree, when seen), `used` (a gradient reached it at some observed step's end), `data` (it
        holds values: not on the meta device, not a lazy module's before its first forward), `readable` (its values
        can be fingerprinted: `fingerprint.readable`), `fp` (its fingerprints, which the digest folds in)."""
        self._used: set[int] = set()
        self.orphaned: list[int] = []
        """Positions (in the observed parameter list) of parameters DDP registered that the tree no longer holds:
        what a replaced module left behind, at the last step."""
        self.retied: list[dict[str, Any]] = []
        """Names that held one of those and now hold another parameter DDP registered (a weight tied after the
        wrap): `name`, `now` (the registered parameter's name), `site` (where it was attached, when seen)."""
        self.recast: list[dict[str, Any]] = []
        """Parameters DDP registered whose dtype or device changed since (a `model.to(torch.bfloat16)` after the
        wrap): their gradients go to a new accumulator that DDP's hooks are not on, so none is all-reduced. `name`,
        `was`, `now` (dtype and device, as text), at most 8, at the last step; `site`: where the script converted the
        module after DDP was built, when seen."""
        self.recast_count = 0
        self.late_buffers: list[dict[str, Any]] = []
        """When DDP does not broadcast buffers: those registered under a new name after the wrap, at the last step:
        `name`, `shape`, `fp` (their fingerprint: the ranks' are compared), `changing` (it changed between two steps
        on this rank), `site` (where it was registered), `readable` (as `unregistered`'s); at most 8."""
        self.late_count = 0
        """How many such buffers there are (the digest covers every one)."""
        self.unreadable: list[dict[str, Any]] = []
        """Those parameters (`unregistered`'s, and the frozen ones) and buffers (`late_buffers`) whose values the
        check cannot read (`fingerprint.readable`), at the last step: `name`, `kind`, `type`, `data`; at most 8."""
        self.stale: int = 0
        """Tensors the optimizer steps that the model no longer holds (DDP registered them), at the last step."""
        self.outside: list[dict[str, Any]] = []
        """Trainable tensors the optimizer steps that neither the module tree nor DDP's reducer ever held (a
        learnable loss temperature kept beside the model), at the last step: `name` (the script's variable holding
        it, when found, else its place in the optimizer's param groups), `shape`, `grad` (it had a gradient when
        the step closed), `fp` (its fingerprint and its gradient's: the ranks' are compared); at most 8. The
        digest covers every one."""
        self.outside_count = 0
        """How many such tensors there are."""
        self._outside_names: dict[int, str] = {}
        self.modules = 0
        """Modules in the tree at the last step (whose modes the digest covers)."""
        self.learning_rates: list[float] = []
        """The observed optimizer's learning rate per param group, at the last step."""

    # ------------------------------------------------------------------------------------------- listening

    def listen(self) -> None:
        """Remember where parameters and modules are attached to the tree from now on."""
        from torch.nn.modules import module as torch_module

        for name in (
            "register_module_parameter_registration_hook",
            "register_module_module_registration_hook",
            "register_module_buffer_registration_hook",
        ):
            register = getattr(torch_module, name, None)
            if register is not None:
                self._removers.append(register(self._on_register))

    def stop(self) -> None:
        for handle in self._removers:
            handle.remove()
        self._removers.clear()

    def _on_register(self, owner: nn.Module, name: str, value: Any) -> None:
        # Called for every module anywhere; only the ones in the observed tree matter, and that test is a set lookup.
        if id(owner) in self._tree and len(self._sites) < _MAX_SITES:
            self._sites[(id(owner), name)] = user_site() or "an unknown place"
            if isinstance(value, nn.Module):
                self._tree.update(id(m) for m in value.modules())

    # ------------------------------------------------------------------------------------------- scanning

    def close_step(self, counters: StepCounters, step: int) -> None:
        """Walk the tree as it is now; fill the step's counters and log what changed."""
        crc = 0
        eval_modules: list[str] = []
        unknown: list[tuple[str, torch.Tensor, str]] = []
        late: list[tuple[str, torch.Tensor, str]] = []
        where: dict[int, str] = {}
        root_training = self._module.training
        self.modules = 0
        for path, m in self._module.named_modules(remove_duplicate=False):
            self.modules += 1
            crc = zlib.crc32(b"%s:%d;" % (path.encode(), m.training), crc)
            if m.training != root_training and len(eval_modules) < 64:
                eval_modules.append(path or "(the model)")
            for child_name, child in m._modules.items():
                if child is not None:
                    where.setdefault(id(child), self._sites.get((id(m), child_name), ""))
            for pname, p in m._parameters.items():
                if p is None or id(p) in self._registered:
                    continue
                site = self._sites.get((id(m), pname)) or where.get(id(m), "")
                unknown.append((f"{path}.{pname}" if path else pname, p, site))
            if self._late_buffers:
                late.extend(
                    (f"{path}.{bname}" if path else bname, b, self._sites.get((id(m), bname)) or where.get(id(m), ""))
                    for bname, b in m._buffers.items()
                    if b is not None and (id(m), bname) not in self._slots
                )
        trainable = [(n, p, s) for n, p, s in unknown if p.requires_grad]
        self._used.update(id(p) for _, p, _ in trainable if p.grad is not None)
        fp_of: dict[int, list[float]] = {}
        if unknown:
            fps = fingerprints([p for _, p, _ in unknown])
            for (name, p, _), fp in zip(unknown, fps.tolist()):
                crc = zlib.crc32(f"{name}={p.requires_grad}:{fp[0]!r},{fp[1]!r};".encode(), crc)
                fp_of[id(p)] = fp
        if late:
            crc = self._scan_late(late, crc)
        else:
            self.late_buffers, self.late_count = [], 0
        self.unreadable = [
            {"name": name, "kind": kind, "type": type(t).__name__, "data": holds_data(t)}
            for kind, held in (("parameter", unknown), ("buffer", late))
            for name, t, _ in held
            if not readable(t)
        ][:8]
        held = {id(p) for p in self._module.parameters()}
        self.orphaned = [i for i, p in enumerate(self._positions) if id(p) not in held]
        if self.orphaned:
            self.retied = self._retied({self._names.get(id(self._positions[i])) for i in self.orphaned})
        self._find_recast()
        stepped = self._stepped()
        outside = [
            (t, f"param_groups[{g}]['params'][{k}]")
            for i, (t, g, k) in stepped.items()
            if i not in held and i not in self._registered
        ]
        self.stale = sum(1 for i in stepped if i not in held) - len(outside)
        if self._beside is not None:
            outside += [(t, where) for t, where in self._beside() if id(t) not in stepped]
        if outside:
            crc = self._scan_outside(outside, crc)
        else:
            self.outside, self.outside_count = [], 0
        crc = self.beside_modules.scan(crc)
        counters.state_digest = crc & 0x7FFFFFFF
        counters.unregistered = len(trainable)
        self.unregistered = [
            {
                "name": n,
                "shape": _shape(p),
                "site": s or None,
                "stepped": id(p) in stepped if stepped else None,
                "used": id(p) in self._used,
                "data": holds_data(p),
                "readable": readable(p),
                "fp": fp_of[id(p)],
            }
            for n, p, s in trainable
        ][:64]
        entry = {
            "training": root_training,
            "other_mode": eval_modules[:_MAX_NAMED],
            "other_mode_count": len(eval_modules),
            "unregistered": [n for n, _, _ in trainable[:_MAX_NAMED]],
        }
        if entry != self._last and len(self.log) < MAX_STATE_LOG:
            self.log.append({"step": step, **entry})
        self._last = entry

    def _scan_outside(self, outside: list[tuple[torch.Tensor, str]], crc: int) -> int:
        """Fold the trainable tensors the optimizer steps beside the model, and their gradients, into the digest
        `crc`, and remember them (`outside`)."""
        trained = [(t, where) for t, where in outside if t.requires_grad]
        fps = fingerprints([t for t, _ in trained]).tolist()
        grads = fingerprints([t.grad for t, _ in trained]).tolist()
        if any(id(t) not in self._outside_names for t, _ in trained):
            self._outside_names.update(variable_names([t for t, _ in trained], sys._getframe(1)))
        entries = []
        for (t, where), fp, grad in zip(trained, fps, grads):
            crc = zlib.crc32(f"outside {where}:{fp[0]!r},{fp[1]!r},{grad[0]!r},{grad[1]!r};".encode(), crc)
            name = self._outside_names.get(id(t)) or where
            entries.append({"name": name, "shape": _shape(t), "grad": t.grad is not None, "fp": fp + grad})
        self.outside, self.outside_count = entries[:8], len(entries)
        return crc

    def _scan_late(self, late: list[tuple[str, torch.Tensor, str]], crc: int) -> int:
        """Fold the buffers registered after the wrap into the digest `crc`, and remember them (`late_buffers`)."""
        fps = fingerprints([b for _, b, _ in late]).tolist()
        entries = []
        for (name, b, site), fp in zip(late, fps):
            crc = zlib.crc32(f"buffer {name}:{fp[0]!r},{fp[1]!r};".encode(), crc)
            if self._late_fp.setdefault(name, tuple(fp)) != tuple(fp):
                self._late_moved.add(name)  # it changed since its first step: a running statistic
            moved = name in self._late_moved
            entries.append(
                {
                    "name": name,
                    "shape": _shape(b),
                    "fp": fp,
                    "changing": moved,
                    "site": site or None,
                    "readable": readable(b),
                }
            )
        self.late_buffers, self.late_count = entries[:8], len(entries)
        return crc

    def _find_recast(self) -> None:
        changed = [
            (i, p)
            for i, (p, (dtype, device)) in enumerate(zip(self._positions, self._kinds))
            if p.dtype != dtype or p.device != device
        ]
        self.recast_count = len(changed)
        after = CAST_SITES[self._casts_before :]
        self.recast = [
            {
                "name": self._names.get(id(p)),
                "was": f"{str(self._kinds[i][0]).removeprefix('torch.')} on {self._kinds[i][1]}",
                "now": f"{str(p.dtype).removeprefix('torch.')} on {p.device}",
                "site": after[-1] if after else None,
            }
            for i, p in changed[:8]
        ]

    def _retied(self, left: set[str | None]) -> list[dict[str, Any]]:
        """The names in `left` (those of parameters DDP registered that the tree no longer holds) that now hold
        another parameter DDP registered."""
        found = []
        for path, m in self._module.named_modules(remove_duplicate=False):
            for pname, p in m._parameters.items():
                name = f"{path}.{pname}" if path else pname
                if p is not None and id(p) in self._registered and name in left and self._names.get(id(p)) != name:
                    site = self._sites.get((id(m), pname))
                    found.append({"name": name, "now": self._names.get(id(p)), "site": site})
        return found[:8]

    def optimizer_holds(self, tensors: list[torch.Tensor]) -> list[tuple[bool, bool]]:
        """Per tensor: (the observed optimizer holds it, in a param group whose learning rate is 0 now)."""
        opt = self._optimizer() if self._optimizer is not None else None
        rates = {id(p): g.get("lr") for g in opt.param_groups for p in g["params"]} if opt is not None else {}
        return [(id(t) in rates, id(t) in rates and rates[id(t)] == 0) for t in tensors]

    def _stepped(self) -> dict[int, tuple[torch.Tensor, int, int]]:
        """The tensors the observed optimizer steps, by identity, each with its place in the param groups (group,
        position; empty: none known yet); its learning rates noted."""
        opt = self._optimizer() if self._optimizer is not None else None
        if opt is None:
            return {}
        self.learning_rates = [_number(g.get("lr")) for g in opt.param_groups]
        return {id(p): (p, g, i) for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])}


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _shape(t: torch.Tensor) -> list[int] | None:
    """`t`'s shape; None for a lazy module's parameter before its first forward (reading it raises)."""
    return None if is_lazy(t) else list(t.shape)
