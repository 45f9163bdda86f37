"""One rank's side of a sharded model's exchange (FSDP2, `replicate`): the rounds in order, what each puts in and
reads back, from the rank's `ShardedRecord`. `drive` runs them over the process group, `simulate.lockstep` for every
rank in one process.

| round | collectives | puts | reads back |
|---|---|---|---|
| slots | MAX | `SLOTS`: counts, flags, a saved file's path digest, the step clock's figures | `top`, `low` |
| gradients | MAX, when every rank saw a step with sync on and as many parameters | per parameter: a gradient, a nonzero one, moved | `grads` |
| unsharded | MAX, when every rank has as many | the unsharded parameters' fingerprints | `unsharded_differ` |
| buffers | MAX, when every rank has as many | the buffers' fingerprints, changed since the first step | `buffers_*` |
| steps | MAX | per observed step: inputs, gradient scale and norm, settings, modes and collectives digests, batches drawn | `per_step` |
| replicas | MAX, when the model is replicated (`replicate`, HSDP); MAX, `oddranks` rounds where rows differ | the replicas' fingerprints and their sum at each observed step, per replica row | `replicas` |
| apart | `oddranks` rounds, 2 SUMs, per digest that differs | the settings', modes' or collectives' digest, then what two ranks hold | `settings_apart`, `modes_apart`, `collectives_apart` |
| saves | SUM, SUM, SUM, when some rank saved shards | who saved, then what the first saver wrote | `shard_save` |
| slowest | MAX, when a rank's own work is the longest | the step clock's quartiles | `slowest` |
| samplers | `oddranks` rounds and 2 SUMs, or 3 SUMs, when the training loaders' DistributedSamplers differ or one is not its rank's | the sampler's digest, then two ranks' loader records | `samplers` |
| beside | SUM, when every rank found its group beside the data-parallel mesh (tensor parallelism); SUM where some group's inputs differ (`beside_inputs.py`) | per observed step, the inputs' digest weighted to cancel within each group; then by group slot | `beside` |

Every collective's op and shape depend on the slots' reduced values and earlier results only, never on local data.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from ddp_doctor.core.agreed import HeldApart
from ddp_doctor.core.beside import BesideGroup
from ddp_doctor.core.sharded_run import INPUT_STEPS, SCALE_TOLERANCE
from ddp_doctor.exchange.beside_inputs import beside_inputs_rounds
from ddp_doctor.exchange.oddranks import odd_ranks_rounds
from ddp_doctor.exchange.packing import Op, Reply, from_words, to_words
from ddp_doctor.exchange.primitives import minmax_rounds
from ddp_doctor.exchange.sharded_replicas import replicas_rounds
from ddp_doctor.exchange.timing import slowest_rank

__all__ = [
    "NOBODY",
    "SLOTS",
    "STEP_COLUMNS",
    "STEP_SHIFT",
    "ShardedRecord",
    "ShardedReduced",
    "count_and_first",
    "held_apart",
    "sharded_protocol",
]

SLOTS = (
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
    "collectives",
    "replica_rows",
    "waiting",
    "timed_steps",
    "wait_s",
    "step_s",
    "comm_timed",
    "own_s",
    "gpu_timed",
    "sampler",
    "sampler_wrong",
    "sampler_has",
    "loader_has",
    "beside_groups",
    "sampler_world",
    "inputs_nonfinite",
)
"""What every rank puts in the first MAX, in this order (float32: each value exact in it)."""
STEP_SHIFT = 2**20
"""`inputs_nonfinite` is step * STEP_SHIFT + rank for the first observed step whose training inputs held NaN or
infinity on this rank (else `NOBODY`): the MIN over the ranks is the first such step and its lowest rank (steps below
`INPUT_STEPS` = 16 and ranks below 2**20 stay exact in float32)."""
NOBODY = 2**24
"""The `saver` slot of a rank that saved no shards (above any rank, exact in float32)."""
STEP_COLUMNS = 13
"""The per-step table's columns: inputs (fingerprint, fingerprint, seen), gradient scale (ratio, seen), gradient norm
(squared, nonfinite, seen), settings digest, modes digest, seen, the script's collectives' digest and the batches
the training loader handed out for the step (both seen with the settings)."""


@dataclass(kw_only=True, slots=True)
class ShardedRecord:
    """What one rank of a sharded model puts into the exchange, measured on that rank (`sharded_report.py`)."""

    slots: dict[str, float]
    """Its figures, by `SLOTS` name."""
    grads: torch.Tensor | None = None
    """float32[P, 3], per parameter of the model: it had a gradient at a step with sync on, a nonzero one, its
    weights moved since the first observed step. None where no such step was seen."""
    unsharded: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.float64))
    """float64[U, 2]: the fingerprints of the parameters outside every sharded group (NaN as 0)."""
    buffers: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 3, dtype=torch.float64))
    """float64[B, 3]: each buffer's fingerprint (NaN as 0) and whether it changed since the first observed step."""
    steps: torch.Tensor = field(default_factory=lambda: torch.zeros(INPUT_STEPS, STEP_COLUMNS, dtype=torch.float64))
    """float64[INPUT_STEPS, STEP_COLUMNS]: the first observed steps' measures (`STEP_COLUMNS`)."""
    held: list[tuple[float, Any, float, Any, float, Any]] = field(default_factory=list)
    """Per observed step: the optimizer settings' digest and text, the modules' modes digest and first entry, the
    script's collectives' digest and first calls (`plain_watch.PlainOptimizerWatch.step_collectives`)."""
    replicas: torch.Tensor | None = None
    """float64[P, 4]: per parameter, its local tensor's fingerprints after the first observed step and after the
    last, zeros where it is not replicated (`sharded_replicas.py`); None where nothing is."""
    replica_steps: torch.Tensor | None = None
    """float64[INPUT_STEPS, 2]: per observed step, the sum of the fingerprints of this rank's local replicated
    tensors after its optimizer step, and 1 where the step was measured (the step at which copies part); None where
    nothing is replicated."""
    replica_row: int = 0
    """This rank's replica row (`ShardedModel.replica_row`)."""
    saved: dict[str, Any] | None = None
    """What this rank's first save of shards wrote (`shown`, `site`, `shards`); None where it saved none."""
    clock: dict[str, Any] | None = None
    """Its step clock's figures (`StepClock.stats`); None where no clock ran."""
    loader: dict[str, Any] | None = None
    """The training loader's record (`dataloaders.describe`, with its sampler's settings); None where none fed the
    observed steps."""
    beside: BesideGroup | None = None
    """This rank's group beside the data-parallel mesh (tensor parallelism); None where there is none."""


@dataclass(kw_only=True, slots=True)
class ShardedReduced:
    """What every rank reads back from `sharded_protocol`, identical on every rank."""

    top: dict[str, float]
    low: dict[str, float]
    grads: torch.Tensor | None
    """The MAX of every rank's `ShardedRecord.grads`; None when some rank saw no step with sync on, or the ranks
    hold different numbers of parameters."""
    unsharded_differ: list[bool]
    unsharded_gap: float
    buffers_differ: list[bool]
    buffers_moved: list[bool]
    per_step: dict[str, Any]
    """`ShardedRun`'s per-step fields."""
    replicas: dict[str, Any]
    """`ShardedRun`'s `replica*` fields."""
    shard_save: dict[str, Any]
    """`ShardedRun`'s `shard_save*` fields ({} where no file holds some ranks' shards only)."""
    slowest: dict[str, Any] | None
    samplers: dict[str, Any] | None = None
    """`ShardedRun.samplers_apart`."""
    beside: dict[str, Any] = field(default_factory=dict)
    """`ShardedRun`'s `beside_*` fields."""


def sharded_protocol(record: ShardedRecord, *, rank: int, world: int) -> Generator[Op, Reply, ShardedReduced]:
    """One rank's side of a sharded model's exchange (group ranks of the default group). Yields collectives,
    returns the `ShardedReduced`."""
    high, lowest = yield from minmax_rounds(torch.tensor([float(record.slots[k]) for k in SLOTS]))
    top, low = ({k: v.item() for k, v in zip(SLOTS, r)} for r in (high, lowest))
    grads = None
    if low["grad_steps"] > 0 and top["params"] == low["params"]:
        mine = record.grads if record.grads is not None else torch.zeros(int(top["params"]), 3)
        grads, _ = yield from minmax_rounds(mine)
    n = len(record.unsharded)
    if top["unsharded"] != low["unsharded"]:  # the ranks hold different ones: none can be compared
        differ, gap = [True] * n, float("inf") if n else 0.0
    elif n:
        high, lowest = yield from minmax_rounds(record.unsharded)
        differ = (high != lowest).any(-1).tolist()
        gap = float((high - lowest).abs().amax()) if any(differ) else 0.0
    else:
        differ, gap = [], 0.0
    buffers_differ: list[bool] = []
    buffers_moved: list[bool] = []
    if top["buffers"] == low["buffers"] > 0:
        high, lowest = yield from minmax_rounds(record.buffers)
        buffers_differ, buffers_moved = (high[:, :2] != lowest[:, :2]).any(-1).tolist(), (high[:, 2] > 0).tolist()
    per_step = yield from _per_step(record, rank=rank, world=world)
    replicas = yield from replicas_rounds(
        record.replicas, record.replica_steps, record.replica_row, top, low, rank=rank, world=world
    )
    shard_save = yield from _shard_save(record.saved, top, low, rank=rank)
    slowest = yield from slowest_rank(record.clock, top, low, rank=rank)
    samplers = yield from _samplers(record, top, low, rank=rank, world=world)
    groups = int(top["beside_groups"]) if top["beside_groups"] == low["beside_groups"] else 0
    beside = yield from beside_inputs_rounds(record.steps, record.beside, per_step["inputs_compared"], groups)
    return ShardedReduced(
        top=top,
        low=low,
        grads=grads,
        unsharded_differ=differ,
        unsharded_gap=gap,
        buffers_differ=buffers_differ,
        buffers_moved=buffers_moved,
        per_step=per_step,
        replicas=replicas,
        shard_save=shard_save,
        slowest=slowest,
        samplers=samplers,
        beside=beside,
    )


def _per_step(record: ShardedRecord, *, rank: int, world: int) -> Generator[Op, Reply, dict[str, Any]]:
    """`ShardedRun`'s per-step fields, from the first `INPUT_STEPS` observed steps, in one MAX: the training inputs'
    fingerprints (`inputs_*`), the gradient shards' scale from the backward's end to the step (`scale_*`), their
    norm at the step (`grads_*`), and the digests of the optimizer's settings, of the modules' modes and of the
    script's collectives (`settings_apart`, `modes_apart`, `collectives_apart`), and the batches the training loader
    handed out for each step (`drawn_apart`). Each measure has a presence column: a step counts where every rank measured
    it."""
    high, low = yield from minmax_rounds(record.steps)
    every = range(INPUT_STEPS)
    seen = [k for k in every if low[k, 2] == 1]
    scaled = [k for k in every if low[k, 4] == 1]
    differ = [k for k in scaled if float(high[k, 3]) > float(low[k, 3]) * (1 + SCALE_TOLERANCE)]
    measured = [k for k in every if low[k, 7] == 1 and high[k, 6] == 0]
    held = [k for k in every if low[k, 10] == 1]
    apart = {}
    for name, column, at in (("settings_apart", 8, 0), ("modes_apart", 9, 2), ("collectives_apart", 11, 4)):
        step = next((k for k in held if high[k, column] != low[k, column]), None)
        apart[name] = None
        if step is not None:
            digest, shown = record.held[step][at : at + 2]
            apart[name] = HeldApart(step=step, **(yield from held_apart(float(digest), shown, rank=rank, world=world)))
    step = next((k for k in held if high[k, 12] != low[k, 12]), None)
    apart["drawn_apart"] = None
    if step is not None:
        drawn = float(record.steps[step, 12])
        site = (record.loader or {}).get("site")
        apart["drawn_apart"] = HeldApart(
            step=step, **(yield from held_apart(drawn, (int(drawn), site), rank=rank, world=world))
        )
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
        **apart,
    }


def held_apart(digest: float, held: Any, *, rank: int, world: int) -> Generator[Op, Reply, dict[str, Any]]:
    """Once a MAX showed that the ranks' `digest`s differ: the reference copy (the most common digest, the lowest
    rank on a tie), the ranks holding another one (`oddranks.odd_ranks_rounds`: the lowest few named, the rest
    counted), and `held` (a small picklable value: a text, an entry) as the reference rank and the first other rank
    hold it. Its volume does not grow with the world size.

    Returns:
        `reference` (its rank), `ranks` (the named other ranks), `more` (how many others are not named), `held`
        ({rank: value} for the reference rank and the first other rank).
    """
    [odd] = yield from odd_ranks_rounds(torch.tensor([[digest]], dtype=torch.float64), rank=rank, world=world)
    shown = yield from _values_of(held, [odd.reference, odd.odd.examples[0]], rank=rank)
    return {"reference": odd.reference, "ranks": odd.odd.examples, "more": odd.odd.more, "held": shown}


def count_and_first(flag: bool, shown: Any, first: int, *, rank: int) -> Generator[Op, Reply, tuple[int, Any]]:
    """How many ranks set `flag`, and `shown` as rank `first` holds it (a small picklable value: a site, a path,
    a shape). One SUM of one number, then `_values_of`: the volume does not grow with the world size."""
    count = yield ("sum", torch.tensor([1.0 if flag else 0.0]))
    shown_by = yield from _values_of(shown, [first], rank=rank)
    return int(count.tensor.item()), shown_by[first]


def _values_of(value: Any, sources: list[int], *, rank: int) -> Generator[Op, Reply, dict[int, Any]]:
    """`value` as each rank of `sources` holds it (a small picklable value), on every rank: one SUM of the sources'
    lengths, one SUM of their bytes (the other ranks add zeros)."""
    data = pickle.dumps(value)
    lengths = torch.tensor([len(data) if rank == s else 0 for s in sources], dtype=torch.int64)
    sizes = (yield ("sum", lengths)).tensor.tolist()
    words = -(-max(sizes) // 8)
    rows = torch.zeros(len(sources), words, dtype=torch.int64)
    for i, s in enumerate(sources):
        if rank == s:
            rows[i] = to_words(data, words)
    got = (yield ("sum", rows)).tensor
    return {s: pickle.loads(from_words(got[i], sizes[i])) for i, s in enumerate(sources)}  # noqa: S301  (the ranks' own bytes)


def _shard_save(
    saved: dict[str, Any] | None, top: dict[str, float], low: dict[str, float], *, rank: int
) -> Generator[Op, Reply, dict[str, Any]]:
    """Whether sharded state went to a file that holds some ranks' shards only: saved by some ranks, or by every
    rank to one path. Then how many ranks saved, and what the first of them wrote (its line, its file, a
    parameter's shard shape). `ShardedRun`'s `shard_save*` fields."""
    if top["saved"] == 0:
        return {}
    every, one_path = low["saved"] == 1, top["path"] == low["path"]
    if every and not one_path:
        return {}  # each rank its own file of its own shards: a per-rank sharded checkpoint
    first = int(low["saver"])
    shown = None if saved is None else {k: saved[k] for k in ("shown", "site", "shards")}
    count, shown = yield from count_and_first(saved is not None, shown, first, rank=rank)
    return {
        "shard_save": shown,
        "shard_save_ranks": count,
        "shard_save_first": first,
        "shard_save_one_path": every and one_path,
    }


def _samplers(
    record: ShardedRecord, top: dict[str, float], low: dict[str, float], *, rank: int, world: int
) -> Generator[Op, Reply, dict[str, Any] | None]:
    """When every rank's training loader has a DistributedSampler and their shared settings differ
    (`held_apart` on the digest), or some rank's is not its own (a SUM counts them, then ranks 0 and 1 send
    theirs): the loader records of two ranks, reference first (`held`), the other ranks named (`ranks`, `more`)."""
    if world < 2 or low["sampler_has"] < 1 or (top["sampler"] == low["sampler"] and top["sampler_wrong"] < 1):
        return None
    if top["sampler"] != low["sampler"]:
        apart = yield from held_apart(record.slots["sampler"], record.loader, rank=rank, world=world)
        return {"held": apart["held"], "ranks": apart["ranks"], "more": apart["more"]}
    count = yield ("sum", torch.tensor([float(record.slots["sampler_wrong"])]))
    shown = yield from _values_of(record.loader, [0, 1], rank=rank)
    wrong = int(count.tensor.item())
    return {"held": shown, "ranks": [1], "more": max(0, wrong - 2)}
