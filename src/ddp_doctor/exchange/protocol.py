"""One rank's side of the check's exchange: the rounds, what each rank puts in them, and what it reads back.

Round A agrees on the step counts (and rank 0's `ModelInfo` when the ranks' differ); round B reduces every local
fact that needs only the common step count; B2 and C run only when something differs (gradients masked by what
every rank trains; rank 0's fingerprints of the differing parameters); round D evaluates the predicates that name
ranks; round E carries strings from a bounded set of example ranks; then the usage patterns (`figures.py`) and the
timing medians (`timing.py`) and each rank's step phases (`ranktable.py`, the one round that grows with W).
"""

from __future__ import annotations

import json
from collections.abc import Generator

import torch

from ddp_doctor.core.figures import rank_grid
from ddp_doctor.core.records import CRASH_KINDS, ModelInfo, RankRecord
from ddp_doctor.exchange.local import (
    at_step,
    curve_of,
    first_set,
    info_json,
    leading_complete,
    logged,
    names_in_message,
    rows_of,
    training_loader,
    windows,
)
from ddp_doctor.exchange.packing import (
    MIN,
    MaxRound,
    Op,
    Reply,
    SumRound,
    bool_digest,
    differs,
    element_hashes,
    from_words,
    hash_steps,
    of_record,
    order_key,
    text_digest,
    to_words,
    unkey,
)
from ddp_doctor.exchange.patterns import local_gaps, patterns
from ddp_doctor.exchange.ranktable import per_rank
from ddp_doctor.exchange.summary import PREDICATES, SAVE_BUCKETS, SLOTS, Summary, examples_from
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
    partial = torch.zeros(n_params, dtype=torch.bool)
    if lead < record.steps:
        partial = record.used[lead] | record.reachable[lead]

    def grad_hashes() -> torch.Tensor:
        """int64[S, P]: each gradient fingerprint's hash (recomputed where needed rather than held while waiting)."""
        return of_record(record, "grad_fp", s, hash_steps)

    # Round B: every local fact that needs only the common step count.
    b = SumRound(world)
    b.bits("used", used, of_record(record, "used", s, bool_digest))
    b.bits("trainable", trainable, of_record(record, "trainable", s, bool_digest))
    b.bits("ran", record.ran[:s].any(0) if s else torch.zeros(n_params, dtype=torch.bool))
    b.bits("partial", partial)
    b.bits("varies", used.any(0) != used.all(0) if s >= 2 else torch.zeros(n_params, dtype=torch.bool))
    b.bits("after_crash", partial & ~used.all(0) if s >= 1 else torch.zeros(n_params, dtype=torch.bool))
    forwards, bypasses = record.counter("ddp_forwards"), record.counter("bypass_forwards")
    hits = ((bypasses > 0) & (forwards == 0)).nonzero().flatten().tolist()
    bypass_used = torch.zeros(n_params, dtype=torch.bool)
    for step in hits:
        bypass_used |= record.used[step]
    hit_steps = torch.zeros(pad_steps, dtype=torch.bool)
    hit_steps[hits] = True
    b.bits("bypass_used", bypass_used)
    b.bits("bypass_steps", hit_steps)
    empty = torch.zeros(pad_steps, dtype=torch.bool)
    if s:
        empty[:s] = ~trainable.any(-1)
    b.bits("empty", empty)
    missing = torch.zeros(n_params, dtype=torch.bool)
    if CRASH_KINDS[record.crash_kind] == "reduction-error" and lead:
        missing = ~record.used[lead - 1]
    b.bits("missing", missing)
    b.bits("rank0_trainable", trainable[-1] if rank == 0 and s else torch.zeros(n_params, dtype=torch.bool))
    crash_steps = torch.zeros(len(CRASH_KINDS), pad_steps + 2, dtype=torch.bool)
    if record.crash_kind:
        crash_steps[record.crash_kind, min(max(record.crash_step + 1, 0), pad_steps + 1)] = True
    b.bits("crash_steps", crash_steps)
    b.bits("buffer_nan", record.buffer_fp[:s].isnan().all(-1))
    b.bits("input", (record.input_fp[:s] != 0).any(-1))
    loader = training_loader(record)
    b.ints("loader", torch.tensor([int(loader is not None)]))
    # The files written with torch.save, hashed into a fixed number of buckets: how many ranks wrote into each
    # (SUM) and whether their paths there agree (MAX == MIN of the bucket's digest); `checkpoint-same-path`.
    save_counts = torch.zeros(SAVE_BUCKETS, dtype=torch.int64)
    save_digests = [0] * SAVE_BUCKETS
    bucket_of: dict[str, int] = {}
    for saved in record.saves:
        h = text_digest(saved["path"])
        k = h % SAVE_BUCKETS
        save_counts[k] = 1
        save_digests[k] ^= h
        bucket_of[saved["path"]] = k
    b.ints("saves", save_counts)
    b.bits("bn_training", record.counter("batchnorm_training")[:s] > 0)

    m = MaxRound()
    m.pair("sections", b.digests())
    mask = trainable & ~ignored
    grad_h = grad_hashes()
    m.pair("grad_p", (grad_h * mask).sum(0))
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
    sizes = record.counter("batch_size")[:s]
    sizes = sizes[sizes > 0]
    m.pair(
        "batch_size",
        torch.tensor([int(sizes.max()), int(sizes.min())]) if sizes.numel() else torch.zeros(2, dtype=torch.int64),
        bool(sizes.numel()),
    )
    m.pair("save_digest", torch.tensor(save_digests, dtype=torch.int64), save_counts > 0)
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
        mask = train_all & ~ignored
        grad_h = grad_hashes()
        b2.pair("grad_p", (grad_h * mask).sum(0))
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
    shared_saves = [d for d in record.saves if shared[bucket_of[d["path"]]]]

    # Round C, only when gradients or weights differ: digests of each rank's differing slice against rank 0's
    # (to name the ranks), and rank 0's fingerprints there (for the largest difference and the divergence curve).
    g_ref = w_ref = 0
    g_mine = w_mine = 0
    w_nan = False
    gap_local = 0.0
    w_nan0 = False
    w_curve = torch.zeros(s + 1, dtype=torch.float64)
    g_curve = torch.zeros(s, dtype=torch.float64)
    w_missing = torch.zeros(s + 1, 0, dtype=torch.bool)
    g_missing = torch.zeros(s, 0, dtype=torch.bool)
    if bool(grad_params.any() or weight_params.any()):
        c = MaxRound()
        g_mine = int(grad_hashes()[:, grad_params].sum()) if s else 0
        w_slice = record.weight_fp[: s + 1][:, weight_params]
        g_slice = record.grad_fp[:s][:, grad_params]
        w_mine = int(element_hashes(w_slice).sum()) if w_slice.numel() else 0
        w_nan = bool(w_slice.isnan().any())
        c.slot("ref", torch.tensor([g_mine, w_mine, int(w_nan)]), rank == 0)
        rc = c.read((yield ("max", c.tensor())))
        g_ref, w_ref, w_nan0 = int(rc["ref"][0]), int(rc["ref"][1]), bool(rc["ref"][2])
        both = torch.cat([w_slice.reshape(-1), g_slice.reshape(-1)]).to(torch.float64)
        words = to_words(both.contiguous().numpy().tobytes() if rank == 0 else b"", both.numel())
        got = yield ("sum", words if rank == 0 else torch.zeros_like(words))
        ref = got.tensor.view(torch.float64)
        w0, g0 = ref[: w_slice.numel()].reshape(w_slice.shape), ref[w_slice.numel() :].reshape(g_slice.shape)
        if w_slice.numel():
            gap_local = float((w_slice[..., 0] - w0[..., 0]).abs().nan_to_num(0).max())
        w_curve, w_missing = local_gaps(w_slice, w0, torch.ones(w_slice.shape[:2], dtype=torch.bool))
        g_curve, g_missing = local_gaps(g_slice, g0, (rb["trainable"] == world)[:, grad_params])

    # Round D: the predicates, plus what needs the inferred `tracked` (hidden parameters).
    checkpoints = record.counter("reentrant_checkpoints")
    hidden = torch.zeros(2, n_params, dtype=torch.bool)
    hidden_steps = torch.zeros(2, pad_steps, dtype=torch.bool)
    hidden_rank = [False, False]
    hidden_crash = [0, 0]
    mark_twice = CRASH_KINDS.index("mark-ready-twice")
    for step in range(record.steps):
        if not forwards[step]:
            continue
        target = 1 if checkpoints[step] else 0
        found = record.used[step] & ~record.reachable[step] & tracked
        named = False
        if record.crash_kind == mark_twice and step == record.crash_step:
            idx = names_in_message(info, record.crash_message)
            found[idx] = True
            named = bool(idx)
            hidden_crash[target] = 1
        if bool(found.any()) or named or checkpoints[step]:
            hidden[target] |= found
            hidden_steps[target, step] = True
            hidden_rank[target] = True
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
    unpaired_sites = [
        site.split(": ", 1)[1]
        for site in record.unpaired_sites
        if first_unpaired is not None and int(site.split(":", 1)[0].split()[1]) == first_unpaired
    ]
    broadcast_sites = [
        site.split(": ", 1)[1]
        for site in record.broadcast_sites
        if first_bcast is not None and int(site.split(":", 1)[0].split()[1]) == first_bcast
    ]
    c0 = rm["coll0"]
    coll_differs = first_coll is not None and bool((coll[first_coll] != c0[first_coll]).any())
    scale_differs = first_scale is not None and int(scale[first_scale]) != int(rm["scale0"][first_scale])
    flags = {
        "lacking": lacking,
        "bypass": bool(hits),
        "grad-differs": bool(rank >= 1 and grad_params.any() and g_mine != g_ref),
        "weight-differs": bool(rank >= 1 and weight_params.any() and (w_mine != w_ref or w_nan or w_nan0)),
        "no-trainable": bool(empty.any()),
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
        "optimizer-differs": first_settings is not None
        and int(settings[first_settings]) != int(rm["settings0"][first_settings]),
        "skipped-step": first_skip is not None and int(stepped[first_skip]) == 0,
        "changed-outside": first_changed is not None and bool(changed[first_changed]),
        "rereduced": first_rereduced is not None and bool(rereduced[first_rereduced]),
        "scheduler-extra": first_sched is not None and int(sched[first_sched]) == int(sh_hi[first_sched]),
        "same-path-save": bool(shared_saves),
    }
    assert tuple(flags) == PREDICATES
    meta = json.dumps(
        {
            "crash_kind": record.crash_kind,
            "crash_step": record.crash_step,
            "crash_message": record.crash_message,
            "bypass_sites": sorted(set(record.bypass_sites)),
            "blocked_checkpoints": sorted(set(record.blocked_checkpoints)),
            "loaders": record.loaders,
            "window_sites": window_sites,
            "unpaired_sites": unpaired_sites,
            "broadcast_sites": broadcast_sites,
            "collective_log": logged(record, first_coll) if first_coll is not None else [],
            "scale": int(scale[first_scale]) if first_scale is not None else 0,
            "optimizer": at_step(record.optimizer_log, first_settings),
            "scheduler_sites": at_step(record.scheduler_sites, first_sched),
            "changed_sites": at_step(record.changed_sites, first_changed),
            "skip_sites": at_step(record.repeat_sites, first_skip + 1) if first_skip is not None else [],
            "changed_params": record.changed_params if first_changed is not None else [],
            "rereduce_sites": at_step(record.rereduce_sites, first_rereduced),
            "shared_saves": shared_saves,
            "module_saves": [d for d in record.saves if d.get("module_prefix")][:1],
        }
    ).encode()
    d = SumRound(world)
    d.ints("counts", torch.tensor([int(v) for v in flags.values()]))
    d.bits("hidden", hidden)
    d.bits("hidden_steps", hidden_steps)
    d.ints("hidden_crash", torch.tensor(hidden_crash))
    d.bits("w_missing", w_missing.any(-1))
    d.bits("g_missing", g_missing)
    dm = MaxRound()
    me = torch.full((len(PREDICATES), SLOTS), MIN, dtype=torch.int64)
    for k, v in enumerate(flags.values()):
        if v:
            me[k, rank % SLOTS] = -rank
    dm.slot("slots", me, True)
    dm.pair("meta_len", torch.tensor([len(meta)]))
    dm.pair("gap", order_key(torch.tensor([gap_local])))
    dm.pair("curve", order_key(torch.cat([w_curve, g_curve])))
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
    wanted = {0}
    for name in (
        "crashed",
        "bypass-sites",
        "blocked-sites",
        "extra-passes",
        "unpaired-extra",
        "broadcast-extra",
        "collective-differs",
        "scale-differs",
        "optimizer-differs",
        "skipped-step",
        "changed-outside",
        "rereduced",
        "scheduler-extra",
    ):
        wanted.update(examples[name].ranks)
    wanted.update(examples["fewest-batches"].ranks[:1])
    wanted.update(examples["same-path-save"].ranks[:1])
    chosen = sorted(wanted)  # at most 3 + 13 * EXAMPLES ranks, whatever W
    n_meta = int(rdm["meta_len"][0][0])
    words = -(-n_meta // 8)
    e = torch.zeros(len(chosen), words, dtype=torch.int64)
    if rank in chosen:
        e[chosen.index(rank)] = to_words(meta, words)
    got = yield ("sum", e.reshape(-1))
    metas = {}
    for i, r in enumerate(chosen):
        raw = from_words(got.tensor.reshape(len(chosen), words)[i], n_meta).rstrip(b"\0")
        metas[r] = json.loads(raw.decode())

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
        per_rank=phases,
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
        batchnorm_training=rb["bn_training"] > 0,
        batch_sizes=(int(rm["batch_size"][0][0]), int(rm["batch_size"][1][1]))
        if int(rm["batch_size"][0][0]) != MIN
        else None,
        patterns=list(zip(grids, members)),
        patterns_omitted=omitted,
        curve=curve_of(rdm["curve"][0], s, rd["w_missing"] > 0, (rd["g_missing"] > 0).sum(-1)),
    )
