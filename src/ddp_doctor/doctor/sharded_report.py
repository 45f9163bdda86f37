"""The report of an FSDP2 or `replicate` model that a `PlainOptimizerWatch` followed (`plain_watch.py`): what the
optimizer steps, the parameters outside every sharded group, gradient sync, unused parameters, checkpoints of
shards, a low reduce dtype, the all-gathers per step, the step time and whether anything changed, gathered in a few
fixed-shape collectives and decided by `analyze/sharded.py`. The watch is `ddp-doctor check`'s in a script with no
DDP model, and `observe()`'s for a sharded model (`sharded_doctor.py`).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddp_doctor.analyze import diagnose_sharded
from ddp_doctor.core.findings import ParamRef
from ddp_doctor.core.fingerprint import fingerprints_batched
from ddp_doctor.core.frames import user_site
from ddp_doctor.core.sharded_run import INPUT_STEPS, SCALE_TOLERANCE, ShardedRun
from ddp_doctor.exchange.primitives import comm_device, minmax
from ddp_doctor.exchange.shard_collectives import count_and_first, held_apart
from ddp_doctor.exchange.timing import slowest_rank
from ddp_doctor.observation.grad_scale import GradScale
from ddp_doctor.observation.sharding import GatherCount, ReducePrecisionProbe, ShardedModel, reshards_fully
from ddp_doctor.observation.step_clock import StepClock, input_wait
from ddp_doctor.report.model import Report, RunFacts

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
"""Set on an FSDP2 module by the patched `set_requires_gradient_sync(False)`: where the script called it."""
IGNORED_ATTR = "_ddp_doctor_ignored_site"
"""Set on each parameter the script passed to the patched `fully_shard` as `ignored_params`: that call's line."""
_SLOTS = (
    "unsharded",
    "buffers",
    "sync_off",
    "changed",
    "saved",
    "saver",
    "path",
    "grad_steps",
    "params",
    "low_reduces",
    "low_abs",
    "low_rel",
    "gathers",
    "unsharded_changed",
    "waiting",
    "timed_steps",
    "wait_s",
    "step_s",
    "comm_timed",
    "own_s",
    "gpu_timed",
)
"""What every rank puts in the sharded report's one min/max reduction, in this order."""
_NOBODY = 2**24
"""The `saver` slot of a rank that saved no shards (above any rank, exact in float32)."""


def record_creation_site(optimizer: torch.optim.Optimizer) -> None:
    """Remember where the script created `optimizer` (called from a wrapper of `Optimizer.__init__`)."""
    if getattr(optimizer, SITE_ATTR, None) is None:
        setattr(optimizer, SITE_ATTR, user_site())


class ShardedWatch(Protocol):
    """What the report reads of the watch that followed the sharded model's steps (`PlainOptimizerWatch`)."""

    optimizer: torch.optim.Optimizer | None
    steps: int
    framework: str
    frozen: bool
    sync_off_steps: int
    shard_saves: list[dict[str, Any]]
    weights_at_first: torch.Tensor | None
    buffers_at_first: torch.Tensor | None
    grad_seen: torch.Tensor | None
    grad_nonzero: torch.Tensor | None
    grad_steps: int
    gathers: GatherCount | None
    gathers_per_step: list[int]
    input_fps: list[torch.Tensor | None]
    replica_state: list[tuple[int, str, int, dict[str, Any]]]
    grad_scale: GradScale | None
    probe: ReducePrecisionProbe | None
    clock: StepClock | None
    in_process: bool
    """Following for `observe()`, which sees no `fully_shard` call and names no failure of the run; False for
    `ddp-doctor check`."""

    def stepped_params(self) -> list[torch.Tensor]: ...

    def facts(self, *, sharding: dict[str, Any] | None = None) -> RunFacts: ...


def _buffers(
    w: ShardedWatch, buffers: list[tuple[str, torch.Tensor]], top: dict[str, float], low: dict[str, float], device: Any
) -> tuple[list[bool], list[bool]]:
    """Per buffer of the sharded model: (it differs across ranks now, it changed on some rank since the first
    observed step). One min/max over the buffers' fingerprints and change flags, when every rank holds as many."""
    if not buffers or top["buffers"] != low["buffers"]:
        return [], []
    now = fingerprints_batched(b for _, b in buffers).nan_to_num(0.0)
    first = w.buffers_at_first
    moved = (
        (now != first.nan_to_num(0.0)).any(-1)
        if first is not None and first.shape == now.shape
        else torch.zeros(len(buffers), dtype=torch.bool)
    )
    high, lowest = minmax(torch.cat([now, moved.double()[:, None]], dim=1), None, device)
    differ = (high[:, :2] != lowest[:, :2]).any(-1)
    return differ.tolist(), (high[:, 2] > 0).tolist()


def _low_reduce(probe: ReducePrecisionProbe | None) -> tuple[str, str] | None:
    """(the dtype FSDP2 reduced in, the weights' dtype) from the probe, as the report names them."""
    if probe is None or probe.low_dtype is None:
        return None
    return str(probe.low_dtype).removeprefix("torch."), "float32"


def sharded_report(w: ShardedWatch, model: ShardedModel) -> Report:
    """The FSDP2 findings: what the optimizer steps, the parameters outside every group, gradient sync, unused
    parameters, checkpoints of shards, and whether anything changed. Collective, every call decided by values
    every rank holds alike: one fixed-shape min/max of `_SLOTS`; one over which parameters had a gradient (when
    every rank saw a step with sync on); one over the unsharded parameters' fingerprints (when every rank has the
    same number of them); two more when some rank saved shards (`_shard_save`)."""
    assert w.optimizer is not None
    named = model.named_parameters()
    in_model = {id(p) for _, p in named}
    stepped = w.stepped_params()
    unsharded = model.unsharded() if dist.get_world_size() > 1 else []  # one rank: nothing to keep in sync
    # FSDP2 shards parameters only: a buffer stays a plain tensor on each rank, and nothing broadcasts it (DDP and
    # `replicate` broadcast theirs from rank 0).
    buffers = list(model.root.named_buffers()) if dist.get_world_size() > 1 and model.api == "fully_shard" else []
    now = fingerprints_batched(p for _, p in named)
    before = w.weights_at_first if w.weights_at_first is not None else now
    moved = (now.nan_to_num(0.0) != before.nan_to_num(0.0)).any(-1)
    changed = bool(moved.any())
    outside = {id(p) for _, p in unsharded}
    unsharded_changed = bool(moved[[i for i, (_, p) in enumerate(named) if id(p) in outside]].any())
    device = comm_device(None, named[0][1].device if named else None)
    saved = w.shard_saves[0] if w.shard_saves else None
    probe = w.probe
    if probe is not None:
        probe.remove()
    local = {
        "unsharded": len(unsharded),
        "buffers": len(buffers),
        "sync_off": w.sync_off_steps,
        "changed": changed,
        "saved": saved is not None,
        "saver": dist.get_rank() if saved else _NOBODY,
        "path": zlib.crc32(saved["path"].encode()) & 0xFFFFFF if saved else -1,  # exact in float32
        "grad_steps": w.grad_steps,
        "params": len(named),
        "low_reduces": probe.low_calls if probe else 0,
        "low_abs": probe.worst_abs if probe else 0.0,
        "low_rel": probe.mean_relative if probe else 0.0,
        "gathers": _steady_gathers(w),
        "unsharded_changed": unsharded_changed,
        **StepClock.slots(w.clock),
    }
    reduced = minmax(torch.tensor([float(local[k]) for k in _SLOTS]), None, device)
    top, low = ({k: v.item() for k, v in zip(_SLOTS, r)} for r in reduced)
    unused: list[ParamRef] = []
    never_updated: list[tuple[ParamRef, bool, bool]] = []  # (the parameter, the optimizer holds it, at lr 0)
    if low["grad_steps"] > 0 and top["params"] == low["params"] and w.grad_seen is not None:
        # Every rank saw a step with gradient sync on, and the same parameters: per parameter, over the ranks,
        # whether it had a gradient, a gradient other than 0, and whether its weights moved.
        nonzero = w.grad_nonzero if w.grad_nonzero is not None else torch.zeros_like(w.grad_seen)
        table = torch.stack([w.grad_seen.float(), nonzero.float(), moved.float()], dim=1)
        seen, _ = minmax(table, None, device)
        rates = {id(p): g.get("lr") for g in w.optimizer.param_groups for p in g["params"]}
        for (n, p), (had, nonzero_any, moved_any) in zip(named, seen.tolist()):
            ref = ParamRef(n, p.numel(), tuple(p.shape))
            if p.requires_grad and not had:
                unused.append(ref)
            elif p.requires_grad and nonzero_any and not moved_any:
                never_updated.append((ref, id(p) in rates, rates.get(id(p)) == 0))
    differ = [False] * len(unsharded)
    gap = 0.0
    if unsharded and top["unsharded"] == low["unsharded"]:
        high, lowest = minmax(fingerprints_batched(p for _, p in unsharded).nan_to_num(0.0), None, device)
        differ = (high != lowest).any(-1).tolist()
        gap = float((high - lowest).abs().amax()) if differ else 0.0
    elif unsharded:
        differ = [True] * len(unsharded)
        gap = float("inf")
    buffers_differ, buffers_moved = _buffers(w, buffers, top, low, device)
    per_step = _per_step(w, device)
    shard_save = _shard_save(saved, top, low, device)
    sync_site = next((getattr(m, SYNC_OFF_ATTR) for _, m in model.sharded if getattr(m, SYNC_OFF_ATTR, None)), None)
    sharding = model.describe()
    if top["gathers"] == low["gathers"] >= 0:
        sharding["all_gathers_per_step"] = int(top["gathers"])
    run = ShardedRun(
        world=dist.get_world_size(),
        steps=w.steps,
        optimizer=type(w.optimizer).__qualname__,
        optimizer_site=getattr(w.optimizer, SITE_ATTR, None),
        framework=w.framework,
        sharding=sharding,
        model_params=sum(p.requires_grad for _, p in named),
        replaced=sum(id(p) not in in_model for p in stepped),
        model_params_stepped=sum(id(p) in in_model for p in stepped),
        model_changed=bool(top["changed"]),
        unsharded=[ParamRef(n, p.numel(), tuple(p.shape)) for n, p in unsharded],
        unsharded_differ=differ,
        unsharded_gap=gap,
        unsharded_changed=bool(top["unsharded_changed"]),
        weights_dtype=sorted({str(p.dtype).removeprefix("torch.") for _, p in named}),
        buffers_compared=len(buffers_differ),
        buffers_made_apart=[
            ParamRef(n, b.numel(), tuple(b.shape))
            for (n, b), d, m in zip(buffers, buffers_differ, buffers_moved)
            if d and not m
        ],
        buffers_apart_in_training=[
            ParamRef(n, b.numel(), tuple(b.shape))
            for (n, b), d, m in zip(buffers, buffers_differ, buffers_moved)
            if d and m
        ],
        **per_step,
        modules=sum(1 for _ in model.root.named_modules(remove_duplicate=False)),
        learning_rates=[float(g.get("lr", float("nan"))) for g in w.optimizer.param_groups] if w.optimizer else [],
        ignored_site=next((getattr(p, IGNORED_ATTR) for _, p in unsharded if hasattr(p, IGNORED_ATTR)), None),
        ignored=[hasattr(p, IGNORED_ATTR) for _, p in unsharded],
        unused=unused,
        never_updated=[ref for ref, _, _ in never_updated],
        never_updated_held=sum(held for _, held, _ in never_updated),
        never_updated_zero_lr=sum(zero for _, _, zero in never_updated),
        sync_off_steps=int(top["sync_off"]),
        sync_off_site=sync_site,
        low_reduce=_low_reduce(probe) if low["low_reduces"] > 0 else None,
        reshard_candidate=_reshard_candidate(w, model) if "all_gathers_per_step" in sharding else None,
        input_wait=input_wait(top, low),
        comm_timed=low["comm_timed"] >= 1,
        slowest=slowest_rank(w.clock and w.clock.stats(), top, low, device),
        timed_steps=int(low["timed_steps"]),
        gpu_timed=low["gpu_timed"] >= 1,
        low_reduce_abs=top["low_abs"],
        low_reduce_rel=top["low_rel"],
        followed=w.frozen,
        in_process=w.in_process,
        **shard_save,
    )
    return Report.build(w.facts(sharding=run.sharding), diagnose_sharded(run))


def _per_step(w: ShardedWatch, device: torch.device) -> dict[str, Any]:
    """`ShardedRun`'s per-step fields, from the first `INPUT_STEPS` observed steps, in one fixed-shape min/max: the
    training inputs' fingerprints (`inputs_*`), the gradient shards' scale from the backward's end to the step
    (`scale_*`, `GradScale.ratios`), their norm at the step (`grads_*`, `GradScale.norms`), and the digests of the
    optimizer's settings and of the modules' modes (`settings_apart`, `modes_apart`). Each measure has a presence
    column: a step counts where every rank measured it."""
    # fp, fp, seen | ratio, seen | norm, nonfinite, seen | settings, modes, seen
    table = torch.zeros(INPUT_STEPS, 11, dtype=torch.float64)
    for k, fp in enumerate(w.input_fps[:INPUT_STEPS]):
        if fp is not None:
            table[k, 0:3] = torch.tensor([*fp.double().nan_to_num(0.0, 0.0, 0.0).tolist(), 1.0])
    scale = w.grad_scale
    for k, ratio in enumerate(scale.ratios[:INPUT_STEPS] if scale is not None else []):
        if ratio is not None and math.isfinite(ratio) and ratio > 0:
            table[k, 3:5] = torch.tensor([ratio, 1.0])
    for k, sq in enumerate(scale.norms[:INPUT_STEPS] if scale is not None else []):
        if sq is not None:
            table[k, 5:8] = torch.tensor([sq, 0.0, 1.0] if math.isfinite(sq) else [0.0, 1.0, 1.0])
    for k, (settings, _, modes, _) in enumerate(w.replica_state[:INPUT_STEPS]):
        table[k, 8:11] = torch.tensor([float(settings), float(modes), 1.0])
    high, low = minmax(table, None, device)
    every = range(INPUT_STEPS)
    seen = [k for k in every if low[k, 2] == 1]
    scaled = [k for k in every if low[k, 4] == 1]
    differ = [k for k in scaled if float(high[k, 3]) > float(low[k, 3]) * (1 + SCALE_TOLERANCE)]
    measured = [k for k in every if low[k, 7] == 1 and high[k, 6] == 0]
    held = [k for k in every if low[k, 10] == 1]
    return {
        "inputs_compared": seen,
        "inputs_identical": bool(seen) and all(bool((high[k, :2] == low[k, :2]).all()) for k in seen),
        "scale_steps": scaled,
        "scale_differ_steps": differ,
        "scale_spread": math.sqrt(float(high[differ[0], 3]) / float(low[differ[0], 3])) if differ else 1.0,
        "grads_measured_steps": measured,
        "grads_zero_steps": [k for k in measured if high[k, 5] == 0],
        "grads_nonfinite_steps": [k for k in every if high[k, 6] == 1],
        "state_steps": len(held),
        "settings_apart": _apart(w, held, high, low, column=8, device=device),
        "modes_apart": _apart(w, held, high, low, column=9, device=device),
    }


def _apart(
    w: ShardedWatch, held: list[int], high: torch.Tensor, low: torch.Tensor, *, column: int, device: torch.device
) -> dict[str, Any] | None:
    """The first of the steps `held` at which the ranks' digests in `column` differ: that step, the ranks that hold
    another copy than the most common one, and what the reference rank and the first other rank held (the settings'
    text, or the modes' entry). None when they agreed at every step."""
    step = next((k for k in held if high[k, column] != low[k, column]), None)
    if step is None:
        return None
    digest, text, modes, entry = w.replica_state[step]
    mine = (digest, text) if column == 8 else (modes, entry)
    return {"step": step, **held_apart(float(mine[0]), mine[1], device)}


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


def _shard_save(
    saved: dict[str, Any] | None, top: dict[str, float], low: dict[str, float], device: torch.device
) -> dict[str, Any]:
    """Whether sharded state went to a file that holds some ranks' shards only: saved by some ranks, or by every
    rank to one path. Then two more collectives every rank makes alike: how many ranks saved, and what the
    first of them wrote (its line, its file, a parameter's shard shape). `ShardedRun`'s `shard_save*` fields."""
    if top["saved"] == 0:
        return {}
    every, one_path = low["saved"] == 1, top["path"] == low["path"]
    if every and not one_path:
        return {}  # each rank its own file of its own shards: a per-rank sharded checkpoint
    first = int(low["saver"])
    shown = None if saved is None else {k: saved[k] for k in ("shown", "site", "shards")}
    count, shown = count_and_first(saved is not None, shown, first, device)
    return {
        "shard_save": shown,
        "shard_save_ranks": count,
        "shard_save_first": first,
        "shard_save_one_path": every and one_path,
    }
