"""FSDP2 (`fully_shard`) as one rank sees it: which modules are sharded, on what mesh and with which policy, and
whether their gradients are reduced. Local facts only; nothing here communicates, but the `ReducePrecisionProbe`
(a second, float32 reduce-scatter of one backward's gradients, made on every rank alike).

FSDP2 replaces each parameter of a sharded module by a DTensor holding this rank's shard, so a parameter that
stays a plain tensor inside a sharded model belongs to no `fully_shard` group: nothing synchronises it.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddp_doctor.core.compat import fsdp_module_type, is_dtensor, replicate_module_type
from ddp_doctor.observation.wrapstate import user_name

__all__ = [
    "GatherCount",
    "ReducePrecisionProbe",
    "ShardedModel",
    "find_sharded_model",
    "frame_modules",
    "heap_modules",
    "local_tensor",
    "reshards_fully",
    "sharded_model_of",
]

_LOW = (torch.bfloat16, torch.float16)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor, `t` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _groups(module: nn.Module) -> list[Any]:
    """The FSDP parameter groups of one sharded module (`_fsdp_param_groups` from 2.10, `_fsdp_param_group` before)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


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
        """The root's parameters, by the names the user's module gives them (no `torch.compile` `_orig_mod.`)."""
        return [(user_name(n), p) for n, p in self.root.named_parameters()]

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
        return [g for _, m in self.sharded for g in _groups(m)]

    def gradient_sync_on(self) -> bool:
        """Whether every sharded module reduces its gradients now (`set_requires_gradient_sync`; True where the
        flag cannot be read)."""
        return all(getattr(g, "reduce_grads", True) for g in self.param_groups())

    def may_reduce_low(self) -> bool:
        """Whether a sharded group's policy names bfloat16 or float16 (`param_dtype` or `reduce_dtype`) while its
        sharded weights, which the optimizer steps, are float32: then its gradients may be reduced in the low dtype.
        Which dtype FSDP2 really reduces in depends on the release (with `reduce_dtype` unset, 2.13 reduces in
        `param_dtype`, 2.15 in the weights' dtype), so `ReducePrecisionProbe` looks at the reduce-scatter itself.
        False where FSDP2's state cannot be read."""
        try:
            for _, module in self.sharded:
                for group in _groups(module):
                    weights = {fp.sharded_param.dtype for fp in group.fsdp_params}
                    for policy in _policies([group]):
                        if torch.float32 in weights and {policy.reduce_dtype, policy.param_dtype} & set(_LOW):
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
        return any(_reshards(g) is True for g in _groups(module))
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


class ReducePrecisionProbe:
    """Sees the dtype FSDP2 reduces one backward's gradients in, and measures what a low one costs: each sharded
    group's reduce-scatter of a bfloat16 or float16 input also runs on the same input in float32, and the two
    results are compared.

    Installed around FSDP2's private `_reduce_scatter_comm` of each parameter group (2.10 and later; the probe
    does nothing where that is missing), on every rank alike, so the extra collective pairs up across ranks. What is
    measured is the reduction's own rounding: the cast of float32 gradients to the reduce dtype before it (where the
    compute dtype is float32) is not in the number. The float32 reduce-scatter is `reference`, the exchange's
    (`ddp_doctor.exchange.shard_collectives.reduce_scatter_in_float32`): observation communicates through it only."""

    def __init__(self, model: ShardedModel, reference: Callable[..., torch.Tensor]) -> None:
        self.reference = reference
        self._groups = [g for g in model.param_groups() if hasattr(g, "_reduce_scatter_comm")]
        self._saved: list[tuple[Any, Any]] = []
        self.worst_abs = 0.0
        self.diff_sum = 0.0
        self.ref_sum = 0.0
        self.calls = 0
        """Reduce-scatters seen, in any dtype."""
        self.low_calls = 0
        """Those of a bfloat16 or float16 input, measured."""
        self.low_dtype: torch.dtype | None = None

    def install(self) -> None:
        for group in self._groups:
            wrapper = _MeasuredReduceScatter(group._reduce_scatter_comm, self)
            group._reduce_scatter_comm = wrapper
            self._saved.append((group, wrapper))

    def remove(self) -> None:
        for group, wrapper in self._saved:
            _unwrap(group, "_reduce_scatter_comm", wrapper)
        self._saved.clear()

    def note(self, low: torch.Tensor, reference: torch.Tensor) -> None:
        diff = (low.float() - reference).abs()
        self.worst_abs = max(self.worst_abs, float(diff.max())) if diff.numel() else self.worst_abs
        self.diff_sum += float(diff.double().sum())
        self.ref_sum += float(reference.double().abs().sum())
        self.low_calls += 1
        self.low_dtype = low.dtype

    @property
    def mean_relative(self) -> float:
        return self.diff_sum / self.ref_sum if self.ref_sum > 0 else 0.0


def _unwrap(group: Any, attr: str, wrapper: _WrappedComm) -> None:
    """Take `wrapper` out of the group's `attr`, wherever it sits in a chain of wrappers (a check's watch and an
    `observe()` in its script each wrap FSDP2's comms; the one that leaves first must keep the other's)."""
    if getattr(group, attr, None) is wrapper:
        setattr(group, attr, wrapper._inner)
        return
    outer = getattr(group, attr, None)
    while isinstance(outer, _WrappedComm):
        if outer._inner is wrapper:
            outer._inner = wrapper._inner
            return
        outer = outer._inner


class _WrappedComm:
    """One of FSDP2's communication objects (`Comm`: `allocate`, then a call), wrapped: its buffers are its own."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._inner.allocate(size, dtype=dtype, device=device)


class _MeasuredReduceScatter(_WrappedComm):
    """FSDP2's reduce-scatter as it was, then the same input reduced in float32 (when it is a low dtype)."""

    def __init__(self, inner: Any, probe: ReducePrecisionProbe) -> None:
        super().__init__(inner)
        self._probe = probe

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        work = self._inner(
            output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op
        )
        self._probe.calls += 1
        if input_tensor.dtype in _LOW:
            if work is not None:
                work.wait()
                work = None
            reference = self._probe.reference(output_tensor, input_tensor, op, group)
            self._probe.note(output_tensor, reference)
        return work


class GatherCount:
    """How many all-gathers FSDP2 makes (each sharded group's `_all_gather_comm`, wrapped to count its calls; a
    group without one, before 2.10, is not counted), and which non-root sharded module ran its forward last (a
    forward pre-hook on each): the module whose backward comes first, so with `reshard_after_forward=True` its
    parameters are freed after its forward and all-gathered again at once. Local; nothing here communicates."""

    def __init__(self, model: ShardedModel) -> None:
        self.calls = 0
        self.last_forward: str | None = None
        self.counted = False
        self.frozen = False
        """Set at the observed steps' end: the forwards of an epoch end the check follows (an evaluation) do not
        move `last_forward`."""
        self._undo: list[Any] = []
        for name, module in model.sharded:
            for group in _groups(module):
                comm = getattr(group, "_all_gather_comm", None)
                if comm is not None:
                    group._all_gather_comm = wrapper = _CountedAllGather(comm, self)
                    self._undo.append(functools.partial(_unwrap, group, "_all_gather_comm", wrapper))
                    self.counted = True
            if name:
                self._undo.append(module.register_forward_pre_hook(functools.partial(self._forward, name)).remove)

    def remove(self) -> None:
        """Put FSDP2's all-gathers back and take the forward hooks off (the counts stay)."""
        self.frozen = True
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _forward(self, name: str, _module: Any, _args: Any) -> None:
        if self.frozen or _in_backward():
            return  # activation checkpointing recomputes forwards in backward, first block last: not the forward
        self.last_forward = name


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward recomputed by activation
    checkpointing); False where the private call is missing."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class _CountedAllGather(_WrappedComm):
    """FSDP2's all-gather as it was, counted."""

    def __init__(self, inner: Any, count: GatherCount) -> None:
        super().__init__(inner)
        self._count = count

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._count.calls += 1
        return self._inner(*args, **kwargs)
