"""One rank's side of the check's exchange: the rounds, what each rank puts in them, and what it reads back.

Round A agrees on the step counts (and rank 0's `ModelInfo` when the ranks' differ); round B reduces every local
fact that needs only the common step count (`facts.py`); B2 and C run only when something differs (gradients masked
by what every rank trains; rank 0's fingerprints of the differing parameters, `rank0_slices.py`); round D evaluates
the predicates that name ranks; then the usage patterns (`patterns.py`); round E carries strings from a bounded set
of example ranks (`strings.py`); then the timing medians (`timing.py`) and the ranks' step phases
(`ranktable.py`: the rows of a few ranks, counts and medians over ranks).
"""

from __future__ import annotations

import json
from collections.abc import Generator

import torch

from ddp_doctor.core.codes import Code
from ddp_doctor.core.figures import rank_grid
from ddp_doctor.core.records import CRASH_KINDS, ModelInfo, RankRecord
from ddp_doctor.exchange.facts import local_facts
from ddp_doctor.exchange.local import curve_of, first_set, hidden_params, info_json, leading_complete, rows_of, windows
from ddp_doctor.exchange.packing import (
    MIN,
    MaxRound,
    Op,
    Reply,
    SumRound,
    differs,
    from_words,
    hash_steps,
    of_record,
    order_key,
    text_digest,
    to_words,
    unkey,
)
from ddp_doctor.exchange.patterns import patterns
from ddp_doctor.exchange.rank0_slices import against_rank0
from ddp_doctor.exchange.ranktable import per_rank
from ddp_doctor.exchange.strings import example_metas, rank_strings
from ddp_doctor.exchange.summary import PREDICATES, SLOTS, Summary, examples_from
from ddp_doctor.exchange.timing import medians

__all__ = ["protocol"]


def protocol(record: RankRecord, info: ModelInfo, *, rank: int, world: int) -> Generator[Op, Reply, Summary]:
    """One rank's side of the exchange (group ranks). Yields collectives, returns the `Summary`."""
    n_params = record.used.shape[1]
    lead = leading_complete(record)
    info_bytes, info_digest = info_json(info)

    # Round A: the common and padded step counts, and whether every rank holds the same ModelInfo.
    a = MaxRound()
    a.pair("steps", torch.tensor([record.steps, lead]))
    a.pair("info", torch.tensor([info_digest]))
    a.slot("info_len", torch.tensor([len(info_bytes)]), rank == 0)
    ra = a.read((yield ("max", a.tensor())))
    pad_steps, s = int(ra["steps"][0][0]), int(ra["steps"][1][1])
    if bool(differs(ra["info"]).any()):
        # Group rank 0's ModelInfo speaks for the group (names and shapes already agree: they are in the layout
        # hash, checked before); it travels once, from rank 0 only.
        n = int(ra["info_len"][0])
        words = to_words(info_bytes if rank == 0 else b"", -(-n // 8))
        got = yield ("sum", words if rank == 0 else torch.zeros_like(words))
        info = ModelInfo.from_dict(json.loads(from_words(got.tensor, n).decode()))
    tracked = torch.tensor(info.trainable_at_wrap, dtype=torch.bool)
    ignored = torch.tensor(info.ignored, dtype=torch.bool)

    used = record.used[:s]
    trainable = record.trainable[:s]

    def grad_hashes() -> torch.Tensor:
        """int64[S, P]: each gradient fingerprint's hash (recomputed where needed rather than held while waiting)."""
        return of_record(record, "grad_fp", s, hash_steps)

    # Round B: every local fact that needs only the common step count.
    b = SumRound(world)
    facts = local_facts(b, record, s=s, lead=lead, pad_steps=pad_steps, rank=rank)
    loader = facts.loader

    m = MaxRound()
    m.pair("sections", b.digests())
    mask = grad_mask = trainable & ~ignored
    grad_h = grad_hashes()
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
    m.pair("save_digest", facts.save_digests, facts.save_counts > 0)
    rm = m.read((yield ("max", m.tensor())))
    del m
    b.settle(rm["sections"])
    rb = b.read((yield ("sum", b.tensor())))
    del b

    # Round B2, only when some parameter's requires_grad differs across ranks in some step: the gradient digests
    # again, masked by the parameters every rank trains (the mask round B could not know yet).
    train_all = rb["trainable"] == world
    uniform = bool(((rb["trainable"] == 0) | train_all).all())
    if not uniform:
        b2 = MaxRound()
        mask = grad_mask = train_all & ~ignored
        grad_h = grad_hashes()
        grad_p = (grad_h * mask).sum(0)
        b2.pair("grad_p", grad_p)
        b2.pair("grad_s", (grad_h * mask).sum(1))
        del grad_h, mask
        r2 = b2.read((yield ("max", b2.tensor())))
        rm["grad_p"], rm["grad_s"] = r2["grad_p"], r2["grad_s"]

    # What the group knows now.
    unsynced = differs(rm["unsynced"]) if infer else torch.zeros(n_params, dtype=torch.bool)
    if infer:
        extra = int(tracked.sum()) - int(info.wrap_trainable_count or 0)
        if extra > 0 and int((unsynced & tracked).sum()) == extra:
            tracked = tracked & ~unsynced
    grad_params = differs(rm["grad_p"]) & ~ignored if world >= 2 else torch.zeros(n_params, dtype=torch.bool)
    weight_params = differs(rm["weight_p"]) & ~ignored if world >= 2 else torch.zeros(n_params, dtype=torch.bool)

    # Round B3, only when some gradient differs at the optimizer step: the same digests of the gradients as DDP's
    # all-reduce left them. Those that agreed then were changed on some ranks after DDP reduced them (clipping on
    # one rank); the others were never synchronized. Each rank also knows which of its own it changed.
    edited = torch.zeros(n_params, dtype=torch.bool)
    my_edits = torch.zeros(s, dtype=torch.bool)
    if bool(grad_params.any()):
        b3 = MaxRound()
        if record.synced_grad_fp is None:  # the same gradients at the sync as at the step: round B's digest
            b3.pair("synced_p", grad_p)
        else:
            b3.pair("synced_p", (of_record(record, "synced_grad_fp", s, hash_steps) * grad_mask).sum(0))
        r3 = b3.read((yield ("max", b3.tensor())))
        edited = grad_params & ~differs(r3["synced_p"])
        if record.synced_grad_fp is not None and s:
            before, after = record.synced_grad_fp[:s], record.grad_fp[:s]
            changed = ~((before == after) | (before.isnan() & after.isnan())).all(-1)  # [S, P]
            my_edits = (changed & grad_mask & edited).any(1)
    del grad_mask, grad_p
    used_count = rb["used"]
    used_any, used_all = used_count > 0, used_count == world
    live = tracked & ~((rb["trainable"] < world).any(0) if s else torch.zeros_like(tracked))
    rank_dep = live & (used_any != used_all).any(0) if s else torch.zeros_like(live)
    del used_any, used_all, train_all
    n_wins = int(rm["n_windows"][1][0])
    w_hi, w_lo = rm["windows"]
    bad = [k for k in range(n_wins) if int(w_hi[k]) != int(w_lo[k])]
    b_hi, b_lo = (int(v[0]) for v in rm["batches"])
    all_loaders = int(rb["loader"][0]) == world
    u_hi, u_lo = rm["unpaired"]
    first_unpaired = first_set((u_hi != u_lo).tolist())
    bc_hi, bc_lo = rm["bcast"]
    # Steps where the ranks' DDP forwards in grad mode without a backward differ are `unpaired`'s to explain.
    first_bcast = first_set(((bc_hi[:, 1] != bc_lo[:, 1]) & (u_hi == u_lo)).tolist())
    c_hi, c_lo = rm["coll"]
    first_coll = first_set((c_hi != c_lo).any(-1).tolist())
    sc_hi, sc_lo = rm["scale"]
    first_scale = first_set((sc_hi != sc_lo).tolist())

    st_hi, st_lo = rm["stepped"]
    sy_hi, sy_lo = rm["synced"]
    first_skip = first_set(((st_hi != st_lo) & (sy_hi == sy_lo) & (sy_lo > 0)).tolist())
    se_hi, se_lo = rm["settings"]
    first_settings = first_set(((st_lo > 0) & (se_hi != se_lo)).tolist())
    sh_hi, sh_lo = rm["sched"]
    first_sched = first_set((sh_hi != sh_lo).tolist())
    ch_hi, ch_lo = rm["changed"]
    first_changed = first_set((ch_hi != ch_lo).tolist())
    rr_hi, rr_lo = rm["rereduced"]
    first_rereduced = first_set((rr_hi > 0).tolist())
    sd_hi, sd_lo = rm["save_digest"]
    shared = ((rb["saves"] >= 2) & (sd_hi == sd_lo)).tolist()
    shared_saves = [d for d in record.saves if shared[facts.bucket_of[d["path"]]]]

    # Round C, only when gradients or weights differ: which ranks differ from rank 0, and by how much.
    vs0 = yield from against_rank0(
        record,
        s,
        grad_params=grad_params,
        weight_params=weight_params,
        trained_by_all=rb["trainable"] == world,
        grad_hashes=grad_hashes,
        rank=rank,
    )

    # Round D: the predicates, plus what needs the inferred `tracked` (hidden parameters).
    hidden, hidden_steps, hidden_rank, hidden_crash = hidden_params(record, info, tracked, pad_steps)
    first_window = bad[0] if bad else None
    my_passes = wins[first_window][0] if first_window is not None else None
    window_sites: list[str] = []
    if first_window is not None and my_passes == int(w_hi[first_window]):
        window_sites = [
            site.split(": ", 1)[1]
            for site in record.repeat_sites
            if int(site.split(":", 1)[0].split()[1]) in wins[first_window][1]
        ]
    lacking = bool(s and rank_dep.any() and (~used[:, rank_dep]).any())
    c0 = rm["coll0"]
    coll_differs = first_coll is not None and bool((coll[first_coll] != c0[first_coll]).any())
    scale_differs = first_scale is not None and int(scale[first_scale]) != int(rm["scale0"][first_scale])
    flags = {
        "lacking": lacking,
        "bypass": facts.bypassed,
        "grad-differs": bool(rank >= 1 and grad_params.any() and vs0.grad_differs),
        "weight-differs": bool(rank >= 1 and weight_params.any() and vs0.weight_differs),
        "no-trainable": facts.empty_steps,
        **{f"crash:{k}": record.crash_kind == i for i, k in enumerate(CRASH_KINDS) if i},
        "crashed": bool(record.crash_kind),
        "hidden-outside": hidden_rank[0],
        "hidden-reentrant": hidden_rank[1],
        "extra-passes": first_window is not None and my_passes == int(w_hi[first_window]),
        "fewer-passes": first_window is not None and my_passes != int(w_hi[first_window]),
        "fewest-batches": bool(all_loaders and b_hi != b_lo and loader is not None and batches == b_lo),
        "bypass-sites": sites[0] != int(rm["sites0"][0]),
        "blocked-sites": sites[1] != int(rm["sites0"][1]),
        "unpaired-extra": first_unpaired is not None and int(unpaired[first_unpaired]) == int(u_hi[first_unpaired]),
        "unpaired-fewer": first_unpaired is not None and int(unpaired[first_unpaired]) != int(u_hi[first_unpaired]),
        "broadcast-extra": first_bcast is not None and int(bcast[first_bcast, 1]) == int(bc_hi[first_bcast, 1]),
        "broadcast-fewer": first_bcast is not None and int(bcast[first_bcast, 1]) != int(bc_hi[first_bcast, 1]),
        "collective-differs": coll_differs,
        "scale-differs": scale_differs,
        Code.OPTIMIZER_DIFFERS: first_settings is not None
        and int(settings[first_settings]) != int(rm["settings0"][first_settings]),
        "skipped-step": first_skip is not None and int(stepped[first_skip]) == 0,
        "changed-outside": first_changed is not None and bool(changed[first_changed]),
        "rereduced": first_rereduced is not None and bool(rereduced[first_rereduced]),
        "scheduler-extra": first_sched is not None and int(sched[first_sched]) == int(sh_hi[first_sched]),
        "same-path-save": bool(shared_saves),
        # The crashed step had a backward pass through the forward that crashed (a second pass failed).
        "crash-after-pass": bool(
            record.crash_kind
            and 0 <= record.crash_step < record.steps
            and int(record.counter("split_passes")[record.crash_step]) > 0
        ),
        "grads-edited": bool(my_edits.any()),
    }
    assert tuple(flags) == PREDICATES
    meta = rank_strings(
        record,
        window_sites=window_sites,
        shared_saves=shared_saves,
        scale=int(scale[first_scale]) if first_scale is not None else 0,
        unpaired=first_unpaired,
        broadcast=first_bcast,
        collective=first_coll,
        settings=first_settings,
        sched=first_sched,
        changed=first_changed,
        skip=first_skip,
        rereduced=first_rereduced,
        edited=first_set(my_edits.tolist()),
    )
    d = SumRound(world)
    d.ints("counts", torch.tensor([int(v) for v in flags.values()]))
    d.bits("hidden", hidden)
    d.bits("hidden_steps", hidden_steps)
    d.ints("hidden_crash", torch.tensor(hidden_crash))
    d.bits("w_missing", vs0.w_missing.any(-1))
    d.bits("g_missing", vs0.g_missing)
    d.bits("edited_steps", my_edits)
    dm = MaxRound()
    me = torch.full((len(PREDICATES), SLOTS), MIN, dtype=torch.int64)
    for k, v in enumerate(flags.values()):
        if v:
            me[k, rank % SLOTS] = -rank
    dm.slot("slots", me, True)
    dm.pair("meta_len", torch.tensor([len(meta)]))
    dm.pair("gap", order_key(torch.tensor([vs0.gap])))
    dm.pair("curve", order_key(torch.cat([vs0.w_curve, vs0.g_curve])))
    rd = d.read((yield ("sum", d.tensor())))
    rdm = dm.read((yield ("max", dm.tensor())))
    examples = examples_from(rd["counts"], rdm["slots"])

    # The usage map: each rank's grid of cell states, and the distinct grids with the ranks that have them.
    row_names, _, row_of, _ = rows_of(info)
    grid = rank_grid(
        used=used,
        ran=record.ran[:s],
        trainable=trainable,
        tracked=tracked,
        ignored=ignored,
        row_of=row_of,
        rows=len(row_names),
    )
    grids, members, omitted = yield from patterns(grid, rank=rank, world=world)

    # Round E: the strings, from group rank 0 and a bounded set of example ranks.
    metas = yield from example_metas(examples, meta, int(rdm["meta_len"][0][0]), rank=rank)

    # Rounds T: exact medians of the step timings over every rank's common steps.
    timing = yield from medians(record, s, world)
    # Round P: each rank's phases, one row per rank.
    phases = yield from per_rank(record, s, rank, world)

    b_nan = rb["buffer_nan"]
    return Summary(
        info=info,
        world=world,
        steps=s,
        pad_steps=pad_steps,
        used=used_count,
        trainable=rb["trainable"],
        ran=rb["ran"] > 0,
        partial=rb["partial"] > 0,
        varies=rb["varies"] > 0,
        after_crash=rb["after_crash"] > 0,
        bypass_used=rb["bypass_used"] > 0,
        bypass_steps=rb["bypass_steps"] > 0,
        no_trainable_steps=(rb["empty"] > 0)[:s],
        reduction_missing=(rb["missing"] > 0) & tracked,
        rank0_trainable=rb["rank0_trainable"] > 0,
        tracked=tracked,
        crash_steps=rb["crash_steps"] > 0,
        hidden=rd["hidden"] > 0,
        hidden_steps=rd["hidden_steps"] > 0,
        hidden_crashed=[int(v) for v in rd["hidden_crash"]],
        grad_params=grad_params,
        grad_steps=(differs(rm["grad_s"]) if world >= 2 else torch.zeros(s, dtype=torch.bool)),
        edited_params=edited,
        edited_steps=rd["edited_steps"] > 0,
        grads_measured=metas[0].get("grads_measured", {}),
        unsynced=unsynced,
        weight_params=weight_params,
        weight_steps=differs(rm["weight_s"]) if world >= 2 else torch.zeros(s + 1, dtype=torch.bool),
        weight_gap=unkey(int(rdm["gap"][0][0])) if weight_params.any() else 0.0,
        buffer_seen=b_nan == 0,
        buffer_differs=differs(rm["buffer"]),
        input_present=rb["input"] == world,
        input_differs=differs(rm["input"]),
        windows=n_wins,
        window_passes=(w_hi[:n_wins].tolist(), w_lo[:n_wins].tolist()),
        loader_ranks=int(rb["loader"][0]),
        batches=(b_hi, b_lo),
        padded=int(rm["padded"][0]),
        first_batches=[int(v) for v in rm["first_batches"]],
        examples=examples,
        metas=metas,
        timing=timing,
        step_times=phases,
        unpaired=(u_hi.tolist(), u_lo.tolist()),
        broadcasts=(bc_hi, bc_lo),
        collectives=(c_hi, c_lo),
        collectives0=rm["coll0"],
        scales=(sc_hi.tolist(), sc_lo.tolist()),
        scales0=rm["scale0"].tolist(),
        steps_taken=(st_hi.tolist(), st_lo.tolist()),
        synced=(sy_hi.tolist(), sy_lo.tolist()),
        optimizer_differs=first_settings,
        scheduler_steps=(sh_hi.tolist(), sh_lo.tolist()),
        changed=(ch_hi.tolist(), ch_lo.tolist()),
        rereduced=(rr_hi.tolist(), rr_lo.tolist()),
        split_passes=rm["passes"][0][:, 0].tolist(),
        inner_passes=rm["passes"][0][:, 1].tolist(),
        batchnorm_training=rb["bn_training"] > 0,
        batch_sizes=(int(rm["batch_size"][0][0]), int(rm["batch_size"][1][1]))
        if int(rm["batch_size"][0][0]) != MIN
        else None,
        patterns=list(zip(grids, members)),
        patterns_omitted=omitted,
        curve=curve_of(rdm["curve"][0], s, rd["w_missing"] > 0, (rd["g_missing"] > 0).sum(-1)),
    )
