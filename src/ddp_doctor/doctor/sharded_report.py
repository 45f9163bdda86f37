"""The report of an FSDP2 or `replicate` model that a `PlainOptimizerWatch` followed (`plain_watch.py`): each rank's
facts, gathered in a few fixed-shape collectives and decided by the sharded model's detectors (`diagnose_sharded`).
The watch is `ddp-doctor check`'s in a script with no DDP model, and `observe()`'s for a sharded model
(`sharded_doctor.py`)."""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddp_doctor.analyze import diagnose_sharded
from ddp_doctor.core.beside import BesideGroup
from ddp_doctor.core.compat import is_dtensor
from ddp_doctor.core.findings import ParamRef
from ddp_doctor.core.fingerprint import fingerprints_batched, readable
from ddp_doctor.core.frames import user_site, variable_names
from ddp_doctor.core.sharded_run import INPUT_STEPS, ShardedRun
from ddp_doctor.doctor.sharded_tables import (
    ShardedWatch,
    buffer_table,
    first_nonfinite_input,
    replica_steps,
    step_table,
)
from ddp_doctor.exchange.compared import sampler_facts
from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.primitives import comm_device
from ddp_doctor.exchange.sharded_protocol import NOBODY, STEP_SHIFT, ShardedRecord, ShardedReduced, sharded_protocol
from ddp_doctor.observation import dataloaders
from ddp_doctor.observation.mesh_groups import beside_group
from ddp_doctor.observation.shard_comms import ReducePrecisionProbe
from ddp_doctor.observation.sharding import ShardedModel, reshards_fully
from ddp_doctor.observation.step_clock import StepClock, input_wait
from ddp_doctor.report.model import Report

__all__ = [
    "IGNORED_ATTR",
    "SHARD_CALL_ATTR",
    "SITE_ATTR",
    "SYNC_OFF_ATTR",
    "ShardedWatch",
    "record_creation_site",
    "sharded_report",
]

SITE_ATTR = "_ddp_doctor_site"
"""Set on an optimizer by the patched `Optimizer.__init__` (`record_creation_site`): where the script created it."""
SHARD_CALL_ATTR = "_ddp_doctor_shard_call"
"""Set on each module the patched `fully_shard` sharded: (which call it was, 0 the first; the call's line)."""
SYNC_OFF_ATTR = "_ddp_doctor_sync_off_site"
"""Set on an FSDP2 module by the patched `set_requires_gradient_sync(False)` and `set_requires_all_reduce(False)`:
(which of them, where the script called it)."""
IGNORED_ATTR = "_ddp_doctor_ignored_site"
"""Set on each parameter the script passed to the patched `fully_shard` as `ignored_params`: that call's line."""


def record_creation_site(optimizer: torch.optim.Optimizer) -> None:
    """Remember where the script created `optimizer` (called from a wrapper of `Optimizer.__init__`)."""
    if getattr(optimizer, SITE_ATTR, None) is None:
        setattr(optimizer, SITE_ATTR, user_site())


def _beside_model(optimizers: list[torch.optim.Optimizer], in_model: set[int]) -> list[tuple[str, torch.Tensor]]:
    """The plain trainable tensors the `optimizers` step that the model does not hold (a learnable loss
    temperature), each named by the script's variable holding it, or by its place in the param groups."""
    found = [
        (f"param_groups[{g}]['params'][{i}]" + (f" of {type(opt).__name__}" if k else ""), p)
        for k, opt in enumerate(optimizers)
        for g, group in enumerate(opt.param_groups)
        for i, p in enumerate(group["params"])
        if p.requires_grad and id(p) not in in_model and not is_dtensor(p)
    ]
    names = variable_names([p for _, p in found], sys._getframe(1)) if found else {}
    return [(names.get(id(p), place), p) for place, p in found]


def _low_reduce(probe: ReducePrecisionProbe | None) -> tuple[str, str] | None:
    """(the dtype FSDP2 reduced in, the weights' dtype) from the probe, as the report names them."""
    if probe is None or probe.low_dtype is None:
        return None
    return str(probe.low_dtype).removeprefix("torch."), "float32"


@dataclass(frozen=True, slots=True)
class _Looked:
    """What this rank looked at for its report, before any collective: the model's parameters and buffers, those
    outside every group, what moved since the first observed step, the training loader, its group beside the
    data-parallel mesh, its first save of shards."""

    named: list[tuple[str, torch.Tensor]]
    stepped: list[torch.Tensor]
    unsharded: list[tuple[str, torch.Tensor]]
    """Trainable tensors no group holds: the model's, then `beside_model`'s."""
    beside_model: list[tuple[str, torch.Tensor]]
    buffers: list[tuple[str, torch.Tensor]]
    unread: list[tuple[str, torch.Tensor]]
    now: torch.Tensor
    moved: torch.Tensor
    loader: dict[str, Any] | None
    beside: BesideGroup | None
    saved: dict[str, Any] | None
    probe: ReducePrecisionProbe | None


def _look(w: ShardedWatch, model: ShardedModel) -> _Looked:
    """This rank's side, local: no collective."""
    assert w.optimizer is not None
    many = dist.get_world_size() > 1  # one rank: nothing to keep in sync
    named = model.named_parameters()
    in_model = {id(p) for _, p in named}
    optimizers = [w.optimizer, *(opt for opt, alone in list(w.others.items()) if alone)]
    beside_model = _beside_model(optimizers, in_model) if many else []
    # FSDP2's fully_shard and replicate take parameters only: a buffer stays a plain tensor on each rank, and nothing
    # broadcasts it (DDP broadcasts rank 0's).
    buffers = list(model.root.named_buffers()) if many else []
    now = fingerprints_batched(p for _, p in named)
    before = w.weights_at_first if w.weights_at_first is not None else now
    last = dataloaders.last_pass()
    if w.probe is not None:
        w.probe.remove()
    return _Looked(
        named=named,
        stepped=w.stepped_params(),
        unsharded=(model.unsharded() if many else []) + beside_model,
        beside_model=beside_model,
        buffers=buffers,
        unread=[(n, b) for n, b in buffers if not readable(b)],  # their rows are 0 on every rank: not compared
        now=now,
        moved=(now.nan_to_num(0.0) != before.nan_to_num(0.0)).any(-1),
        loader={k: v for k, v in last.info.items() if k != "pass"} if last is not None and last.steps else None,
        beside=beside_group([p for _, p in named], _data_mesh(model), dist.get_rank()),
        saved=w.shard_saves[0] if w.shard_saves else None,
        probe=w.probe,
    )


def _record(w: ShardedWatch, model: ShardedModel, seen: _Looked) -> ShardedRecord:
    """What this rank puts into the exchange (`exchange/sharded_protocol.py`)."""
    named, unsharded, saved, probe, beside = seen.named, seen.unsharded, seen.saved, seen.probe, seen.beside
    outside = {id(p) for _, p in unsharded}
    # The replicas' weights (`replicate`, HSDP): this rank's local tensors after the first step and now.
    slot = model.replica_row() if dist.get_world_size() > 1 and w.weights_at_first is not None else None
    replicas = None
    if slot is not None and w.weights_at_first.shape == seen.now.shape:
        replicas = torch.cat([w.weights_at_first, seen.now], 1).nan_to_num(0.0)
        replicas[~torch.tensor([is_dtensor(p) for _, p in named], dtype=torch.bool)] = 0.0
    local = {
        "unsharded": len(unsharded),
        "buffers": len(seen.buffers),
        "sync_off": w.sync_off_steps,
        "changed": bool(seen.moved.any()),
        "saved": saved is not None,
        "saver": dist.get_rank() if saved else NOBODY,
        "path": zlib.crc32(saved["path"].encode()) & 0xFFFFFF if saved else -1,  # exact in float32
        "grad_steps": w.grad_steps,
        "params": len(named),
        "low_reduces": probe.low_calls if probe else 0,
        "low_abs": probe.worst_abs if probe else 0.0,
        "low_rel": probe.mean_relative if probe else 0.0,
        "gathers": _steady_gathers(w),
        "unsharded_changed": bool(seen.moved[[i for i, (_, p) in enumerate(named) if id(p) in outside]].any()),
        "replica_rows": slot[1] if replicas is not None else 0,
        "collectives": sum(count for _, _, count in w.step_collectives[:INPUT_STEPS]),
        "inputs_nonfinite": first_nonfinite_input(w),
        **StepClock.slots(w.clock),
        **_sampler_slots(seen.loader, model.describe().get("mesh_size")),
        "beside_groups": beside.groups if beside is not None else 0,
    }
    grads = None
    if w.grad_seen is not None:
        nonzero = w.grad_nonzero if w.grad_nonzero is not None else torch.zeros_like(w.grad_seen)
        grads = torch.stack([w.grad_seen.float(), nonzero.float(), seen.moved.float()], dim=1)
    return ShardedRecord(
        loader=seen.loader,
        slots=local,
        grads=grads,
        unsharded=fingerprints_batched(p for _, p in unsharded).nan_to_num(0.0)
        if unsharded
        else torch.zeros(0, 2, dtype=torch.float64),
        buffers=buffer_table(w, seen.buffers),
        steps=step_table(w),
        held=[(*state, *calls[:2]) for state, calls in zip(w.replica_state[:INPUT_STEPS], w.step_collectives)],
        replicas=replicas,
        replica_steps=replica_steps(w.replica_sums) if replicas is not None else None,
        replica_row=slot[0] if replicas is not None else 0,
        saved=None if saved is None else {k: saved[k] for k in ("shown", "site", "shards")},
        clock=w.clock and w.clock.stats(),
        beside=beside,
    )


def sharded_report(w: ShardedWatch, model: ShardedModel) -> Report:
    """The report of a sharded model: this rank's `ShardedRecord` goes through `exchange/sharded_protocol.py`'s
    rounds, whose every collective is decided by values every rank holds alike; the facts they agree on
    (`ShardedRun`) are decided by the sharded model's detectors (`diagnose_sharded`). Collective."""
    seen = _look(w, model)
    device = comm_device(None, seen.named[0][1].device if seen.named else None)
    record = _record(w, model, seen)
    got = drive(sharded_protocol(record, rank=dist.get_rank(), world=dist.get_world_size()), group=None, device=device)
    run = _agreed(w, model, seen, got)
    return Report.build(w.facts(sharding=run.sharding), diagnose_sharded(run))


def _agreed(w: ShardedWatch, model: ShardedModel, seen: _Looked, got: ShardedReduced) -> ShardedRun:
    """The facts every rank agreed on, named by this rank's parameters and buffers."""
    assert w.optimizer is not None
    named, unsharded, unread, probe = seen.named, seen.unsharded, seen.unread, seen.probe
    in_model = {id(p) for _, p in named}
    top, low = got.top, got.low
    rates = {id(p): g.get("lr") for g in w.optimizer.param_groups for p in g["params"]}
    buffers_differ, buffers_moved = got.buffers_differ, got.buffers_moved
    sync_call, sync_site = next(
        (getattr(m, SYNC_OFF_ATTR) for _, m in model.sharded if getattr(m, SYNC_OFF_ATTR, None)), (None, None)
    )
    sharding = model.describe()
    if seen.beside is not None:
        sharding["beside"] = {"dims": seen.beside.dims, "size": len(seen.beside.members[seen.beside.index])}
    if top["gathers"] == low["gathers"] >= 0:
        sharding["all_gathers_per_step"] = int(top["gathers"])
    return ShardedRun(
        world=dist.get_world_size(),
        steps=w.steps,
        optimizer=type(w.optimizer).__qualname__,
        optimizer_site=getattr(w.optimizer, SITE_ATTR, None),
        metric_schedulers=list(w.metric_schedulers),
        framework=w.framework,
        sharding=sharding,
        model_params=sum(p.requires_grad for _, p in named),
        replaced=sum(id(p) not in in_model and id(p) not in w.graded_outside for p in seen.stepped),
        model_params_stepped=sum(id(p) in in_model for p in seen.stepped),
        model_changed=bool(top["changed"]),
        unsharded=[ParamRef(n, p.numel(), tuple(p.shape)) for n, p in unsharded],
        unsharded_differ=got.unsharded_differ,
        unsharded_gap=got.unsharded_gap,
        unsharded_changed=bool(top["unsharded_changed"]),
        replica_rows=got.replicas["replica_rows"],
        replicas_compared=got.replicas["replicas_compared"],
        replicas_apart=_replicas_apart(got.replicas.get("replicas_apart"), named),
        script_collectives=int(top["collectives"]) if top["collectives"] == low["collectives"] else None,
        weights_dtype=sorted({str(p.dtype).removeprefix("torch.") for _, p in named}),
        buffers_compared=len(buffers_differ) - len(unread),
        buffers_unreadable=[f"{n} ({type(b).__name__})" for n, b in unread],
        graph_collectives=w.graph.found,
        inputs_nonfinite=divmod(int(low["inputs_nonfinite"]), STEP_SHIFT) if low["inputs_nonfinite"] < NOBODY else None,
        buffers=[ParamRef(n, b.numel(), tuple(b.shape)) for n, b in seen.buffers] if buffers_differ else [],
        buffers_differ=buffers_differ,
        buffers_moved=buffers_moved,
        **got.per_step,
        modules=sum(1 for _ in model.root.named_modules(remove_duplicate=False)),
        learning_rates=[float(g.get("lr", float("nan"))) for g in w.optimizer.param_groups] if w.optimizer else [],
        ignored_site=next((getattr(p, IGNORED_ATTR) for _, p in unsharded if hasattr(p, IGNORED_ATTR)), None),
        ignored=[hasattr(p, IGNORED_ATTR) for _, p in unsharded],
        outside_model=[i >= len(unsharded) - len(seen.beside_model) for i in range(len(unsharded))],
        params=[ParamRef(n, p.numel(), tuple(p.shape)) for n, p in named],
        params_trainable=[p.requires_grad for _, p in named],
        params_grads=[(bool(a), bool(b), bool(c)) for a, b, c in got.grads.tolist()] if got.grads is not None else None,
        params_held=[id(p) in rates for _, p in named],
        params_zero_lr=[rates.get(id(p)) == 0 for _, p in named],
        sync_off_steps=int(top["sync_off"]),
        sync_off_site=sync_site,
        sync_off_call=sync_call or "set_requires_gradient_sync",
        low_reduce=_low_reduce(probe) if low["low_reduces"] > 0 else None,
        reshard_candidate=_reshard_candidate(w, model) if "all_gathers_per_step" in sharding else None,
        input_wait=input_wait(top, low),
        comm_timed=low["comm_timed"] >= 1,
        slowest=got.slowest,
        timed_steps=int(low["timed_steps"]),
        gpu_timed=low["gpu_timed"] >= 1,
        low_reduce_abs=top["low_abs"],
        low_reduce_rel=top["low_rel"],
        followed=w.frozen,
        in_process=w.in_process,
        **got.shard_save,
        samplers_apart=got.samplers,
        samplers_compared=top["sampler_has"] >= 1,
        loader_compared=top["loader_has"] >= 1,
        **_beside(got.beside, top, seen.loader),
    )


def _sampler_slots(loader: dict[str, Any] | None, mesh_size: int | None) -> dict[str, float]:
    """The `sampler*` slots: the training loader's DistributedSampler (`exchange/compared.sampler_facts`). Whether
    the sampler is this rank's own is judged only when the model's mesh spans the whole world: on a smaller mesh (a
    tensor-parallel dimension beside it) the data-parallel rank and degree are not the world's, and a sampler built
    with them is right."""
    world = dist.get_world_size()
    facts, has = sampler_facts(loader, dist.get_rank(), world)
    own_known = mesh_size == world or not has or loader is None or bool(loader.get("dataset_digest"))
    wrong = float(facts[1]) if own_known else 0.0
    return {
        "sampler": float(int(facts[0]) & 0xFFFFFF),
        "sampler_wrong": wrong,
        "sampler_has": float(has),
        "loader_has": float(loader is not None),
        # a DistributedSampler of the world's size on a smaller mesh: the likely cause of a tensor-parallel group's
        # ranks reading different batches (`beside_inputs`)
        "sampler_world": float(bool(has and mesh_size and mesh_size < world and loader.get("num_replicas") == world)),
    }


def _beside(found: dict[str, Any], top: dict[str, float], loader: dict[str, Any] | None) -> dict[str, Any]:
    """`ShardedRun.beside_*`, with the training loader's line and whether some rank's DistributedSampler held the
    world's size (`sampler_world`) where some group's inputs differ."""
    apart = found.get("beside_apart")
    if apart is None:
        return found
    return {
        **found,
        "beside_apart": {**apart, "sampler_world": top["sampler_world"] >= 1, "site": (loader or {}).get("site")},
    }


def _data_mesh(model: ShardedModel) -> Any:
    """The mesh `fully_shard` was given (FSDP2's private state; None where it cannot be read)."""
    groups = model.param_groups()
    return getattr(getattr(groups[0], "mesh_info", None), "mesh", None) if groups else None


def _replicas_apart(apart: dict[str, Any] | None, named: list[tuple[str, Any]]) -> dict[str, Any] | None:
    """`ShardedRun.replicas_apart`, its parameters named."""
    if apart is None:
        return None
    refs = [ParamRef(named[i][0], named[i][1].numel(), tuple(named[i][1].shape)) for i in apart["params"]]
    return {**apart, "params": refs}


def _steady_gathers(w: ShardedWatch) -> int:
    """The all-gathers of an observed step after the first, when every such step made as many; -1 when not
    counted or when they varied (an evaluation forward in between, say)."""
    counts = set(w.gathers_per_step)
    return counts.pop() if w.gathers is not None and w.gathers.counted and len(counts) == 1 else -1


def _reshard_candidate(w: ShardedWatch, model: ShardedModel) -> dict[str, Any] | None:
    """The non-root sharded module that ran its forward last, when it reshards after forward: its backward starts
    right after that forward, so FSDP2 all-gathers the parameters it just freed again at once. Its name, which
    `fully_shard` call built it, and that call's line. The check advises only a module the patched `fully_shard`
    built (its second run applies the advice to that call); `observe()` sees no call, and names the module alone
    (`ShardedWatch.in_process`)."""
    name = w.gathers.last_forward if w.gathers is not None else None
    module = dict(model.sharded).get(name) if name else None
    if module is None or not reshards_fully(module):
        return None
    call = getattr(module, SHARD_CALL_ATTR, None)
    if call is None:
        return {"module": name, "call": None, "site": None} if w.in_process else None
    return {"module": name, "call": call[0], "site": call[1]}
