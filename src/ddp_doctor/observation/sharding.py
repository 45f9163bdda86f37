"""FSDP2 (`fully_shard`) as one rank sees it: which modules are sharded, on what mesh and with which policy, and
whether their gradients are reduced. Local facts only; nothing here communicates. The probes on FSDP2's own
collectives (the dtype of its reduce-scatter, its all-gathers per step) are in `observation/shard_comms.py`.

FSDP2 replaces each parameter of a sharded module by a DTensor holding this rank's shard, so a parameter that
stays a plain tensor inside a sharded model belongs to no `fully_shard` group: nothing synchronises it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddp_doctor.core.compat import fsdp_module_type, is_dtensor, replicate_module_type
from ddp_doctor.observation.wrapstate import user_name

__all__ = [
    "LOW_DTYPES",
    "ShardedModel",
    "fsdp_groups",
    "find_sharded_model",
    "frame_modules",
    "heap_modules",
    "local_tensor",
    "reshards_fully",
    "sharded_model_of",
]

LOW_DTYPES = (torch.bfloat16, torch.float16)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor, `t` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def fsdp_groups(module: nn.Module) -> list[Any]:
    """The FSDP parameter groups of one sharded module (`_fsdp_param_groups` from 2.10, `_fsdp_param_group` before)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _all_reduces(group: Any) -> bool:
    """Whether FSDP2's parameter group all-reduces its gradients across replicas (a 1-D mesh: the property asserts)."""
    try:
        return group._all_reduce_process_group is not None
    except Exception:
        return False


def _dtype(d: torch.dtype | None) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


@dataclass(kw_only=True, slots=True)
class ShardedModel:
    """The model a script sharded with `fully_shard`, as found from the frames of its training loop."""

    root: nn.Module
    """The outermost module holding the sharded ones (the script's `model`), sharded itself or not."""
    sharded: list[tuple[str, nn.Module]] = field(default_factory=list)
    """Every `FSDPModule` under the root, by name ('' for the root)."""

    @property
    def api(self) -> str:
        """`replicate` when every sharded module was built by the FSDP2-based `replicate`, else `fully_shard`."""
        replicated = replicate_module_type()
        if replicated is not None and self.sharded and all(isinstance(m, replicated) for _, m in self.sharded):
            return "replicate"
        return "fully_shard"

    @property
    def root_sharded(self) -> bool:
        return any(name == "" for name, _ in self.sharded)

    @property
    def device(self) -> torch.device | None:
        """Where the model's (local) parameters live: the device of our small tensors on NCCL."""
        return next((p.device for p in self.root.parameters()), None)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The root's parameters, by the names the user's module gives them (no `torch.compile` `_orig_mod.`), each
        as its sharded DTensor: after a forward that no backward followed (an evaluation, a print of the output),
        FSDP2 leaves the root's parameters unsharded, registered on the modules as plain tensors the optimizer does
        not hold until the next backward reshards them."""
        sharded = {}
        for group in self.param_groups():
            for fp in getattr(group, "fsdp_params", ()):
                for held in (getattr(fp, "_unsharded_param", None), getattr(fp, "_sharded_post_forward_param", None)):
                    if held is not None:
                        sharded[id(held)] = fp.sharded_param
        return [(user_name(n), sharded.get(id(p), p)) for n, p in self.root.named_parameters()]

    def unsharded(self) -> list[tuple[str, nn.Parameter]]:
        """Trainable parameters that no `fully_shard` group manages: plain tensors, not DTensors."""
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad and not is_dtensor(p)]

    def replica_row(self) -> tuple[int, int] | None:
        """(this rank's row, the rows): ranks holding the same local tensors share a row, their coordinate along the
        mesh's shard dimensions (one row under `replicate`, one per shard under HSDP). None where nothing is
        replicated (`fully_shard` on a 1-D mesh), or the parameters sit on different meshes or placements."""
        params = [q for _, q in self.named_parameters() if is_dtensor(q)]
        mesh, placements = (params[0].device_mesh, tuple(params[0].placements)) if params else (None, ())
        if not any(pl.is_replicate() for pl in placements) or (coordinate := mesh.get_coordinate()) is None:
            return None
        if any(q.device_mesh != mesh or tuple(q.placements) != placements for q in params):
            return None
        row, rows = 0, 1
        for dim, pl in enumerate(placements):
            if pl.is_shard():
                size = mesh.size(dim)
                row, rows = row * size + coordinate[dim], rows * size
        return row, rows

    def param_groups(self) -> list[Any]:
        """FSDP2's parameter groups of every sharded module (private objects: read, never relied on)."""
        return [g for _, m in self.sharded for g in fsdp_groups(m)]

    def gradient_sync_on(self) -> bool:
        """Whether every sharded module reduces its gradients now (`set_requires_gradient_sync`) and, across the
        replicas of an HSDP or `replicate` mesh, all-reduces them (`set_requires_all_reduce`); True where unread."""
        groups = self.param_groups()
        return all(
            getattr(g, "reduce_grads", True) and (getattr(g, "all_reduce_grads", True) or not _all_reduces(g))
            for g in groups
        )

    def may_reduce_low(self) -> bool:
        """Whether a sharded group's policy names bfloat16 or float16 (`param_dtype` or `reduce_dtype`) while its
        sharded weights, which the optimizer steps, are float32: then its gradients may be reduced in the low dtype.
        Which dtype FSDP2 really reduces in depends on the release (with `reduce_dtype` unset, 2.13 reduces in
        `param_dtype`, 2.15 in the weights' dtype), so `ReducePrecisionProbe` looks at the reduce-scatter itself.
        False where FSDP2's state cannot be read."""
        try:
            for _, module in self.sharded:
                for group in fsdp_groups(module):
                    weights = {fp.sharded_param.dtype for fp in group.fsdp_params}
                    for policy in _policies([group]):
                        if torch.float32 in weights and {policy.reduce_dtype, policy.param_dtype} & set(LOW_DTYPES):
                            return True
        except AttributeError:
            return False
        return False

    def describe(self) -> dict[str, Any]:
        """What the report's header names: the sharded modules, the mesh, resharding and the mixed precision.

        Read from FSDP2's private state, which moves between releases (the mixed-precision policy is the group's
        in 2.13, each parameter's in 2.15): what cannot be read is left out, never raised into the script."""
        groups = self.param_groups()
        out: dict[str, Any] = {"api": self.api, "sharded_modules": len(self.sharded), "root_sharded": self.root_sharded}
        try:
            meshes = {tuple(g.mesh_info.mesh.mesh.shape) for g in groups}
            out["mesh"] = [list(m) for m in sorted(meshes)]
            out["mesh_size"] = max((int(torch.tensor(m).prod()) for m in meshes), default=0)
            out["device_type"] = next(iter({g.mesh_info.mesh.device_type for g in groups}), "")
            names = {tuple(g.mesh_info.mesh.mesh_dim_names or ()) for g in groups}
            if len(names) == 1 and (dims := next(iter(names))):
                out["mesh_dims"] = list(dims)  # an HSDP mesh's: ("replicate", "shard"), say
        except AttributeError:
            pass
        try:
            out["reshard_after_forward"] = sorted({_reshards(g) for g in groups}, key=str)
        except AttributeError:
            pass
        try:
            policies = {(_dtype(p.param_dtype), _dtype(p.reduce_dtype)) for p in _policies(groups)}
            out["param_dtype"] = sorted({p for p, _ in policies if p})
            out["reduce_dtype"] = sorted({r for _, r in policies if r})
        except AttributeError:
            pass
        return out


def _policies(groups: list[Any]) -> list[Any]:
    """The mixed-precision policies in force: the group's (`mp_policy`, 2.13) or its parameters' (2.15)."""
    found = []
    for g in groups:
        policy = getattr(g, "mp_policy", None)
        found += [policy] if policy is not None else [p.mp_policy for p in g.fsdp_params]
    return found


def reshards_fully(module: nn.Module) -> bool:
    """Whether a sharded module frees its unsharded parameters after its forward (`reshard_after_forward=True` in
    force; False where FSDP2's state cannot be read)."""
    try:
        return any(_reshards(g) is True for g in fsdp_groups(module))
    except AttributeError:
        return False


def _reshards(group: Any) -> bool | int:
    """`reshard_after_forward` in force (after FSDP2's lazy init, which turns it off for a root): True, False, or
    the size it reshards to."""
    post = getattr(group, "post_forward_mesh_info", None)
    if post is None:
        return False
    size = getattr(post, "shard_mesh_size", None)
    return True if size is None or size == group.mesh_info.shard_mesh_size else int(size)


def frame_modules(frame: Any) -> Iterator[nn.Module]:
    """The modules in the locals and globals of `frame` and its callers, each once."""
    seen: set[int] = set()
    while frame is not None:
        for value in (*frame.f_locals.values(), *frame.f_globals.values()):
            if isinstance(value, nn.Module) and id(value) not in seen:
                seen.add(id(value))
                yield value
        frame = frame.f_back


def heap_modules() -> list[nn.Module]:
    """Every module this process holds (the garbage collector's list: about 0.1 s for 200,000 objects, paid once,
    where no frame of the loop holds its model: a loop in a class reads `self.model`)."""
    return [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]  # type(): no proxy's __class__


def find_sharded_model(frame: Any, wanted: Iterable[torch.Tensor] = ()) -> ShardedModel | None:
    """The sharded model of a training loop: among the modules in the locals and globals of `frame` and its
    callers, the one that holds the most of `wanted` (the parameters the optimizer steps; a teacher model sharded
    beside the student holds none of them), then the most `FSDPModule`s, then the most parameters. Where no frame's
    module holds any of `wanted` (a loop in a class holds `self`, not the model), every module of the process is
    looked at. None when no module is sharded, or FSDP2 is missing."""
    fsdp = fsdp_module_type()
    if fsdp is None:
        return None
    want = {id(t) for t in wanted}
    key, root = _most_sharded(frame_modules(frame), fsdp, want)
    if root is None or (want and not key[0]):
        heap_key, heap_root = _most_sharded(heap_modules(), fsdp, want)
        if heap_root is not None and (root is None or heap_key[0]):
            root = heap_root
    return None if root is None else sharded_model_of(root)


def sharded_model_of(root: nn.Module) -> ShardedModel:
    """`root` and the `FSDPModule`s under it (none where FSDP2 is missing)."""
    fsdp = fsdp_module_type()
    # A compiled model's modules are named under `_orig_mod` (its root too): the user's names, with the root as ''.
    sharded = [(user_name(f"{n}.")[:-1], m) for n, m in root.named_modules() if fsdp and isinstance(m, fsdp)]
    return ShardedModel(root=root, sharded=sharded)


def _most_sharded(
    modules: Iterable[nn.Module], fsdp: type, want: set[int]
) -> tuple[tuple[int, int, int], nn.Module | None]:
    """The best sharded module by (parameters of `want` held, sharded modules, parameters), with its key."""
    best: tuple[tuple[int, int, int], nn.Module | None] = ((0, 0, 0), None)
    for module in modules:
        n_sharded = sum(isinstance(m, fsdp) for m in module.modules())
        if n_sharded:
            params = list(module.parameters())
            key = (sum(id(p) in want for p in params), n_sharded, len(params))
            if key > best[0]:
                best = (key, module)
    return best
