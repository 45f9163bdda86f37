"""Round B's MAX half: what each rank puts to be compared over the ranks (the MAX and MIN of digests and per-step
counters, group rank 0's values in slots), read back as `Compared`; `FirstSteps`, the first common step at which
the ranks differ in each counter. No collectives here (`facts.exchange_facts` sends it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ddp_doctor.core.records import RankRecord
from ddp_doctor.exchange.common_steps import Agreed
from ddp_doctor.exchange.packing import MaxRound, first_set, hash_steps, of_record, text_digest

__all__ = ["Compared", "FirstSteps", "Mine", "Pair", "grad_hashes", "put_compared", "windows"]

Pair = tuple[torch.Tensor, torch.Tensor]
"""(MAX, MIN) over the ranks of what each rank put, in its shape."""


def grad_hashes(record: RankRecord, s: int) -> torch.Tensor:
    """int64[S, P]: each gradient fingerprint's hash (recomputed where needed rather than held while waiting)."""
    return of_record(record, "grad_fp", s, hash_steps)


def windows(record: RankRecord) -> list[tuple[int, list[int]]]:
    """Per optimizer step: (synced backward passes, the record's step indices in it). Steps are closed by
    optimizer.step() or, when a synced backward was not followed by one, by the next forward."""
    out, count, idx = [], 0, []
    synced, stepped = record.counter("synced_backwards").tolist(), record.counter("optimizer_step").tolist()
    for s, (n, opt) in enumerate(zip(synced, stepped)):
        count, idx = count + n, [*idx, s]
        if opt:
            out.append((count, idx))
            count, idx = 0, []
    return out


@dataclass(kw_only=True, slots=True)
class Mine:
    """What this rank put into round B's MAX that later rounds compare against the group's (the predicates of
    round D name the ranks whose own value is the MAX, or differs from group rank 0's)."""

    grad_p: torch.Tensor
    """int64[P]: the digest of each parameter's gradients over the common steps, masked by `grad_mask`."""
    grad_mask: torch.Tensor
    """bool[P]: the parameters whose gradients are compared (trainable here, not ignored by DDP)."""
    infer: bool
    """Whether the unmasked gradient digests were put too, to infer the wrap-time trainable set."""
    wins: list[tuple[int, list[int]]]
    """`windows`: the synced passes in each optimizer step, and its steps."""
    batches: int
    """Batches per epoch of the training loader (0: none)."""
    sampler: torch.Tensor
    """int64[2]: the training loader's DistributedSampler: the digest of what every rank's must share, and 1 where
    it is not this rank's (its rank or num_replicas is not the group's); zeros without one."""
    sites: list[int]
    """Digests of the bypass sites and of the blocked checkpoints."""
    unpaired: torch.Tensor
    bcast: torch.Tensor
    coll: torch.Tensor
    scale: torch.Tensor
    stepped: torch.Tensor
    settings: torch.Tensor
    sched: torch.Tensor
    changed: torch.Tensor
    rereduced: torch.Tensor
    state: torch.Tensor
    drawn: torch.Tensor
    """The per-step counters above: int64[S] each (`bcast`, `coll`: [S, 2]), as put into `Compared`."""


@dataclass(kw_only=True, slots=True)
class Compared:
    """Round B's MAX read back. A `Pair` is (MAX, MIN) over the ranks; a plain tensor is group rank 0's value (or,
    for `first_batches`, each of the first ranks' own)."""

    sections: Pair
    """int64[sections]: each SUM bit plane's digest (equal: the plane is the same on every rank, not sent)."""
    grad_p: Pair
    """int64[P]: gradient digests over the common steps, masked by what this rank trains."""
    grad_s: Pair
    """int64[S]: the same per step."""
    weight_p: Pair
    """int64[P]: weight digests over the S + 1 points."""
    weight_s: Pair
    """int64[S + 1]: per point, over the parameters DDP does not ignore."""
    buffer: Pair
    """int64[S, B]."""
    input: Pair
    """int64[S]."""
    windows: Pair
    """int64[pad_steps]: synced backward passes in each optimizer step (`windows`)."""
    n_windows: Pair
    """int64[1]: optimizer steps closed."""
    batches: Pair
    """int64[1]: batches per epoch, over the ranks with a training loader."""
    padded: torch.Tensor
    """int64[1]: the most padded samples any rank's sampler added."""
    first_batches: torch.Tensor
    """int64[min(W, 8)]: batches per epoch of group ranks 0.. (-1: unknown)."""
    sampler: Pair
    """int64[2]: `Mine.sampler` over the ranks whose training loader has a DistributedSampler."""
    sampler0: torch.Tensor
    """int64[1]: group rank 0's sampler digest."""
    sites0: torch.Tensor
    """int64[2]: group rank 0's digests of its bypass sites and blocked checkpoints."""
    unpaired: Pair
    """int64[S]: DDP forwards in grad mode without a backward."""
    bcast: Pair
    """int64[S, 2]: DDP's buffer broadcasts, all and those of forwards without grad."""
    coll: Pair
    """int64[S, 2]: the script's own collectives, count and running digest."""
    coll0: torch.Tensor
    scale: Pair
    """int64[S]: GradScaler's scale (float32 bits; 0: no scaler.step())."""
    scale0: torch.Tensor
    stepped: Pair
    """int64[S]: optimizer.step() called."""
    synced: Pair
    """int64[S]: DDP's synced backward passes."""
    settings: Pair
    """int64[S]: the optimizer settings' digest."""
    settings0: torch.Tensor
    sched: Pair
    """int64[S]: LR scheduler step() calls."""
    changed: Pair
    """int64[S]: 1 when parameters changed outside the optimizer."""
    rereduced: Pair
    """int64[S]: the script's collectives on already reduced gradients."""
    passes: Pair
    """int64[S, 2]: backward passes through one forward that used different parameters; passes inside forward."""
    batch_size: Pair
    """int64[2]: (largest, smallest) nonzero batch size (MIN: none seen)."""
    save_digest: Pair
    """int64[SAVE_BUCKETS]: the saved paths' digests per bucket."""
    state: Pair
    """int64[S]: the digest of what the module tree held when the step closed beyond DDP's own lists (modes,
    parameters DDP does not hold: `StepCounters.state_digest`)."""
    state0: torch.Tensor
    unregistered: Pair
    """int64[S]: trainable parameters in the tree that DDP's reducer does not hold."""
    moves: Pair
    """int64[S, 5]: per step, gradients present, exactly zero, not finite; weights that changed, not finite."""
    nonfinite_before: Pair
    """int64[1]: parameters holding a NaN or an infinity before the first step."""
    drawn: Pair
    """int64[S]: batches the training loader handed out for the step (`StepCounters.batches_drawn`)."""
    unsynced: Pair | None = None
    """int64[P]: unmasked gradient digests (only with `Mine.infer`)."""


@dataclass(frozen=True, slots=True)
class FirstSteps:
    """The first common step at which the ranks differ in each per-step counter (None: they agree)."""

    unpaired: int | None
    broadcast: int | None
    """Forwards without grad broadcast buffers differently (where `unpaired` agrees)."""
    collective: int | None
    scale: int | None
    skip: int | None
    """Some ranks called optimizer.step() and others did not, after the same synced passes."""
    settings: int | None
    """Optimizer settings differ in a step every rank took."""
    sched: int | None
    changed: int | None
    """The first step in which the ranks differ in writing parameters outside the optimizer; where none differ, the
    first in which every rank wrote them (the ranks may have written different values)."""
    rereduced: int | None
    """The first step in which some rank reduced gradients again."""
    state: int | None = None
    """The module trees held different modes or unregistered parameters (`Compared.state`)."""
    drawn: int | None = None
    """The first step every rank took in which the ranks drew different numbers of batches for it."""

    @classmethod
    def of(cls, c: Compared) -> FirstSteps:
        (u_hi, u_lo), (bc_hi, bc_lo), (st_hi, st_lo), (sy_hi, sy_lo) = c.unpaired, c.bcast, c.stepped, c.synced
        return cls(
            unpaired=first_set((u_hi != u_lo).tolist()),
            # Steps where the ranks' DDP forwards in grad mode without a backward differ are `unpaired`'s.
            broadcast=first_set(((bc_hi[:, 1] != bc_lo[:, 1]) & (u_hi == u_lo)).tolist()),
            collective=first_set((c.coll[0] != c.coll[1]).any(-1).tolist()),
            scale=first_set((c.scale[0] != c.scale[1]).tolist()),
            skip=first_set(((st_hi != st_lo) & (sy_hi == sy_lo) & (sy_lo > 0)).tolist()),
            settings=first_set(((st_lo > 0) & (c.settings[0] != c.settings[1])).tolist()),
            sched=first_set((c.sched[0] != c.sched[1]).tolist()),
            changed=_first_changed(c.changed),
            rereduced=first_set((c.rereduced[0] > 0).tolist()),
            state=first_set((c.state[0] != c.state[1]).tolist()),
            drawn=first_set(((st_lo > 0) & (c.drawn[0] != c.drawn[1])).tolist()),
        )


def sampler_facts(loader: dict[str, Any] | None, rank: int, world: int) -> tuple[torch.Tensor, bool]:
    """(`Mine.sampler`, whether the training loader has a DistributedSampler, or a sampler over a dataset whose
    digest is known (`observation/datasets.py`)); for every parallelism (a sharded model's exchange puts the
    digest's low 24 bits in its float32 slots)."""
    if loader is not None and loader.get("dataset_digest"):
        # A sampler over the whole dataset (RandomSampler, SequentialSampler): never this rank's own share.
        return torch.tensor([text_digest(["whole", loader["sampler"], loader["dataset_digest"]]), 1]), True
    if loader is None or loader.get("sampler") != "DistributedSampler" or "seed" not in loader:
        return torch.zeros(2, dtype=torch.int64), False
    shared = [loader.get(k) for k in ("seed", "shuffle", "drop_last", "num_replicas", "dataset", "sampled_digest")]
    own = loader["rank"] == rank and loader["num_replicas"] == world
    return torch.tensor([text_digest(shared), int(not own)]), True


def _first_changed(changed: Pair) -> int | None:
    """`FirstSteps.changed`."""
    apart = first_set((changed[0] != changed[1]).tolist())
    return apart if apart is not None else first_set((changed[1] > 0).tolist())


def put_compared(
    m: MaxRound,
    sections: torch.Tensor,
    record: RankRecord,
    agreed: Agreed,
    *,
    loader: dict[str, Any] | None,
    saves: tuple[torch.Tensor, torch.Tensor],
    ignored: torch.Tensor,
    rank: int,
    world: int,
) -> Mine:
    """Fill `m` with this rank's side of every `Compared` field (`sections`: the SUM's bit plane digests; `loader`:
    the training loader; `saves`: the saved paths' bucket counts and digests, `facts.LocalFacts`)."""
    info, s, pad_steps = agreed.info, agreed.steps, agreed.pad_steps
    m.pair("sections", sections)
    # Digests of the fingerprints: gradients, weights, buffers, inputs.
    mask = grad_mask = record.trainable[:s] & ~ignored
    grad_h = grad_hashes(record, s)
    grad_p = (grad_h * mask).sum(0)  # kept: round B3 reuses it where nothing changed the gradients after the sync
    m.pair("grad_p", grad_p)
    m.pair("grad_s", (grad_h * mask).sum(1))
    infer = not info.wrap_state_exact and info.wrap_trainable_count is not None and world >= 2 and s > 0
    if infer:
        m.pair("unsynced", grad_h.sum(0))
    weight_h = of_record(record, "weight_fp", s + 1, hash_steps)
    m.pair("weight_p", weight_h.sum(0))
    m.pair("weight_s", (weight_h * ~ignored).sum(1))
    del grad_h, weight_h, mask
    m.pair("buffer", of_record(record, "buffer_fp", s, hash_steps))
    m.pair("input", of_record(record, "input_fp", s, hash_steps))
    # Optimizer steps and their synced passes; the training loader; the sites rank 0 quotes.
    wins = windows(record)
    counts = torch.full((pad_steps,), 0, dtype=torch.int64)
    counts[: len(wins)] = torch.tensor([c for c, _ in wins], dtype=torch.int64)
    present = torch.arange(pad_steps) < len(wins)
    m.pair("windows", counts, present)
    m.pair("n_windows", torch.tensor([len(wins)]))
    batches = int(loader["batches"]) if loader is not None else 0
    m.pair("batches", torch.tensor([batches]), loader is not None)
    m.slot("padded", torch.tensor([int(loader.get("padded") or 0) if loader is not None else 0]), loader is not None)
    first = torch.full((min(world, 8),), -1, dtype=torch.int64)
    if rank < len(first):
        first[rank] = batches if loader is not None else -1
    m.slot("first_batches", first, torch.arange(len(first)) == rank)
    sampler, distributed = sampler_facts(loader, rank, world)
    m.pair("sampler", sampler, distributed)
    m.slot("sampler0", sampler[:1], rank == 0)
    sites = [text_digest(sorted(set(record.bypass_sites))), text_digest(sorted(set(record.blocked_checkpoints)))]
    m.slot("sites0", torch.tensor(sites), rank == 0)
    # Per common step: DDP forwards in grad mode without a backward, DDP's buffer broadcasts (all, and those of
    # forwards without grad), the script's own collectives (count and running digest) and GradScaler's scale, with
    # group rank 0's values to compare against; the batch sizes.
    unpaired = record.counter("unpaired_forwards")[:s]
    m.pair("unpaired", unpaired)
    bcast = torch.stack([record.counter("ddp_broadcasts")[:s], record.counter("eval_broadcasts")[:s]], 1)
    m.pair("bcast", bcast)
    coll = torch.stack([record.counter("collectives")[:s], record.counter("collective_digest")[:s]], 1)
    m.pair("coll", coll)
    m.slot("coll0", coll, rank == 0)
    scale = record.counter("scaler_scale")[:s]
    m.pair("scale", scale)
    m.slot("scale0", scale, rank == 0)
    # Per common step, aligned by what the ranks do in lockstep (DDP's synced backward passes): whether the rank
    # called optimizer.step(), its optimizer's settings (with rank 0's), LR scheduler calls, parameters changed
    # outside the optimizer, and collectives on gradients DDP had already reduced.
    stepped, synced = record.counter("optimizer_step")[:s], record.counter("synced_backwards")[:s]
    m.pair("stepped", stepped)
    m.pair("synced", synced)
    settings = record.counter("optimizer_digest")[:s]
    m.pair("settings", settings)
    m.slot("settings0", settings, rank == 0)
    sched = record.counter("scheduler_steps")[:s]
    m.pair("sched", sched)
    changed = (record.counter("changed_outside")[:s] > 0).long()
    m.pair("changed", changed)
    rereduced = record.counter("grads_rereduced")[:s]
    m.pair("rereduced", rereduced)
    # Backward passes through one forward that used different parameters, and passes inside DDP's forward.
    m.pair(
        "passes",
        torch.stack([record.counter("split_passes")[:s] == 1, record.counter("inner_passes")[:s] > 0], 1).long(),
    )
    sizes = record.counter("batch_size")[:s]
    sizes = sizes[sizes > 0]
    m.pair(
        "batch_size",
        torch.tensor([int(sizes.max()), int(sizes.min())]) if sizes.numel() else torch.zeros(2, dtype=torch.int64),
        bool(sizes.numel()),
    )
    m.pair("save_digest", saves[1], saves[0] > 0)
    # What the module tree held as each step closed, beyond DDP's registered lists (`observation.tree_scan`).
    state = record.counter("state_digest")[:s]
    m.pair("state", state)
    m.slot("state0", state, rank == 0)
    m.pair("unregistered", record.counter("unregistered")[:s])
    # Whether training moves: finite, nonzero gradients, and steps that change the weights.
    names = ("grads_present", "grads_zero", "grads_nonfinite", "weights_moved", "weights_nonfinite", "inputs_nonfinite")
    m.pair("moves", torch.stack([record.counter(n)[:s] for n in names], 1))
    m.pair("nonfinite_before", (~record.weight_fp[0].isfinite().all(-1)).sum().reshape(1))
    # The batches each step drew from the training loader: equal on ranks that take a step per batch alike.
    drawn = record.counter("batches_drawn")[:s]
    m.pair("drawn", drawn)
    return Mine(
        grad_p=grad_p,
        grad_mask=grad_mask,
        infer=infer,
        wins=wins,
        batches=batches,
        sampler=sampler,
        sites=sites,
        unpaired=unpaired,
        bcast=bcast,
        coll=coll,
        scale=scale,
        stepped=stepped,
        settings=settings,
        sched=sched,
        changed=changed,
        rereduced=rereduced,
        state=state,
        drawn=drawn,
    )
