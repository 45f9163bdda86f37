"""Round D of the check's exchange: the predicates that name ranks. Each rank evaluates every predicate of
`PREDICATES` on its own record against what rounds A to C made common (`evaluate`); one SUM counts the ranks for
each and carries the hidden parameters and the steps the curve misses, one MAX holds the smallest flagged rank of
each class ``rank % SLOTS`` per predicate, the longest string any rank would send (round E) and the curve
(`name_ranks`)."""

from __future__ import annotations

import re
from collections.abc import Generator
from dataclasses import dataclass

import torch

from ddp_doctor.core.codes import Code
from ddp_doctor.core.records import CRASH_KINDS, ModelInfo, RankRecord
from ddp_doctor.core.summary import EXAMPLES, PREDICATES, Curve, Examples
from ddp_doctor.exchange.common_steps import Agreed
from ddp_doctor.exchange.compared import FirstSteps
from ddp_doctor.exchange.facts import Facts
from ddp_doctor.exchange.packing import MIN, MaxRound, Op, Reply, SumRound, first_set, order_key, unkey
from ddp_doctor.exchange.rank0_slices import Rank0Slices
from ddp_doctor.exchange.step_grads import Differing, Synced
from ddp_doctor.exchange.strings import rank_strings

__all__ = ["SLOTS", "Evaluated", "Hidden", "Named", "evaluate", "examples_from", "hidden_params", "name_ranks"]

SLOTS = 64
"""Example slots per predicate: the smallest flagged rank of each class ``rank % SLOTS``. Exact for W <= SLOTS."""


def names_in_message(info: ModelInfo, text: str) -> list[int]:
    """Indices of parameters DDP named in an error message ("... with name head_b.bias has been marked ...")."""
    index = {n: i for i, n in enumerate(info.param_names)}
    return [index[m] for m in re.findall(r"with name (\S+)", text) if m in index]


@dataclass(frozen=True, slots=True)
class Hidden:
    """Parameters that got a gradient DDP's forward did not see coming (used but not reachable from its output),
    split by cause: [0] used outside DDP's forward, [1] inside reentrant activation checkpointing."""

    params: torch.Tensor
    """bool[2, P]."""
    steps: torch.Tensor
    """bool[2, pad_steps]."""
    seen: list[bool]
    """[2]: this rank saw either."""
    crashed: list[int]
    """[2]: this rank's mark-ready-twice crash names them."""


def hidden_params(record: RankRecord, info: ModelInfo, tracked: torch.Tensor, pad_steps: int) -> Hidden:
    n_params = record.used.shape[1]
    hidden = torch.zeros(2, n_params, dtype=torch.bool)
    steps = torch.zeros(2, pad_steps, dtype=torch.bool)
    seen, crashed = [False, False], [0, 0]
    checkpoints, forwards = record.counter("reentrant_checkpoints"), record.counter("ddp_forwards")
    inner, split = record.counter("inner_passes"), record.counter("split_passes")
    mark_twice = CRASH_KINDS.index("mark-ready-twice")
    for step in range(record.steps):
        # Backward passes inside DDP's forward (Lightning's manual optimization) start from a loss, not from the
        # forward's outputs: Lightning prepares DDP's reduction from that loss, so nothing there is hidden from DDP.
        # A mark-ready-twice crash in a later backward pass through the step's forward is that pass's (a parameter
        # reached by two passes), not a parameter used outside forward.
        crashed_here = record.crash_kind == mark_twice and step == record.crash_step
        if not forwards[step] or inner[step] or (crashed_here and split[step]):
            continue
        target = 1 if checkpoints[step] else 0
        found = record.used[step] & ~record.reachable[step] & tracked
        named = False
        if crashed_here:
            idx = names_in_message(info, record.crash_message)
            found[idx] = True
            named = bool(idx)
            crashed[target] = 1
        if bool(found.any()) or named or checkpoints[step]:
            hidden[target] |= found
            steps[target, step] = True
            seen[target] = True
    return Hidden(params=hidden, steps=steps, seen=seen, crashed=crashed)


@dataclass(frozen=True, slots=True)
class Evaluated:
    """This rank's side of round D: its predicates, and the strings round E may ask it for."""

    flags: dict[str, bool]
    """Per predicate, in the order of `PREDICATES`."""
    hidden: Hidden
    window_sites: list[str]
    """The call sites of this rank's extra synced passes in the first optimizer step whose passes differ."""
    shared_saves: list[dict]
    """This rank's torch.save calls whose path another rank wrote too."""
    meta: bytes
    """The strings round E may ask this rank for (`strings.rank_strings`)."""


def evaluate(
    record: RankRecord,
    agreed: Agreed,
    facts: Facts,
    first: FirstSteps,
    differ: Differing,
    vs0: Rank0Slices,
    synced: Synced,
    *,
    rank: int,
    world: int,
) -> Evaluated:
    """Every predicate, on this rank's record against the group's results so far. Local: no collective."""
    s = agreed.steps
    counted, c, mine = facts.counted, facts.compared, facts.mine
    tracked, grad_params, weight_params = differ.tracked, differ.grad_params, differ.weight_params
    used_any, used_all = counted.used > 0, counted.used == world
    live = tracked & ~((counted.trainable < world).any(0) if s else torch.zeros_like(tracked))
    rank_dep = live & (used_any != used_all).any(0) if s else torch.zeros_like(live)
    n_wins = int(c.n_windows[1][0])
    w_hi, w_lo = c.windows
    bad = [k for k in range(n_wins) if int(w_hi[k]) != int(w_lo[k])]
    b_hi, b_lo = (int(v[0]) for v in c.batches)
    all_loaders = int(counted.loader[0]) == world
    sd_hi, sd_lo = c.save_digest
    shared = ((counted.saves >= 2) & (sd_hi == sd_lo)).tolist()
    shared_saves = [d for d in record.saves if shared[facts.local.bucket_of[d["path"]]]]

    hidden = hidden_params(record, agreed.info, tracked, agreed.pad_steps)
    first_window = bad[0] if bad else None
    my_passes = mine.wins[first_window][0] if first_window is not None else None
    window_sites: list[str] = []
    if first_window is not None and my_passes == int(w_hi[first_window]):
        window_sites = [
            site.split(": ", 1)[1]
            for site in record.repeat_sites
            if int(site.split(":", 1)[0].split()[1]) in mine.wins[first_window][1]
        ]
    used = record.used[:s]
    lacking = bool(s and rank_dep.any() and (~used[:, rank_dep]).any())
    u_hi, bc_hi, sh_hi = c.unpaired[0], c.bcast[0], c.sched[0]
    f = first
    coll_differs = f.collective is not None and bool((mine.coll[f.collective] != c.coll0[f.collective]).any())
    scale_differs = f.scale is not None and int(mine.scale[f.scale]) != int(c.scale0[f.scale])
    local = facts.local
    flags = {
        "lacking": lacking,
        "bypass": local.bypassed,
        "grad-differs": bool(rank >= 1 and grad_params.any() and vs0.grad_differs),
        "weight-differs": bool(rank >= 1 and weight_params.any() and vs0.weight_differs),
        "no-trainable": local.empty_steps,
        **{f"crash:{k}": record.crash_kind == i for i, k in enumerate(CRASH_KINDS) if i},
        "crashed": bool(record.crash_kind),
        "hidden-outside": hidden.seen[0],
        "hidden-reentrant": hidden.seen[1],
        "extra-passes": first_window is not None and my_passes == int(w_hi[first_window]),
        "fewer-passes": first_window is not None and my_passes != int(w_hi[first_window]),
        "fewest-batches": bool(all_loaders and b_hi != b_lo and local.loader is not None and mine.batches == b_lo),
        "sampler-apart": bool(
            local.loader is not None
            and (local.loader.get("seed") is not None or bool(local.loader.get("dataset_digest")))
            and (int(c.sampler0[0]) not in (MIN, int(mine.sampler[0])) or bool(mine.sampler[1]))
        ),
        "bypass-sites": mine.sites[0] != int(c.sites0[0]),
        "blocked-sites": mine.sites[1] != int(c.sites0[1]),
        "unpaired-extra": f.unpaired is not None and int(mine.unpaired[f.unpaired]) == int(u_hi[f.unpaired]),
        "unpaired-fewer": f.unpaired is not None and int(mine.unpaired[f.unpaired]) != int(u_hi[f.unpaired]),
        "broadcast-extra": f.broadcast is not None and int(mine.bcast[f.broadcast, 1]) == int(bc_hi[f.broadcast, 1]),
        "broadcast-fewer": f.broadcast is not None and int(mine.bcast[f.broadcast, 1]) != int(bc_hi[f.broadcast, 1]),
        "collective-differs": coll_differs,
        "scale-differs": scale_differs,
        Code.OPTIMIZER_DIFFERS: f.settings is not None
        and int(mine.settings[f.settings]) != int(c.settings0[f.settings]),
        "skipped-step": f.skip is not None and int(mine.stepped[f.skip]) == 0,
        "changed-outside": f.changed is not None and bool(mine.changed[f.changed]),
        "rereduced": f.rereduced is not None and bool(mine.rereduced[f.rereduced]),
        "scheduler-extra": f.sched is not None and int(mine.sched[f.sched]) == int(sh_hi[f.sched]),
        "same-path-save": bool(shared_saves),
        # The crashed step had a backward pass through the forward that crashed (a second pass failed).
        "crash-after-pass": bool(
            record.crash_kind
            and 0 <= record.crash_step < record.steps
            and int(record.counter("split_passes")[record.crash_step]) > 0
        ),
        "grads-edited": bool(synced.my_edits.any()),
        "state-differs": f.state is not None and int(mine.state[f.state]) != int(c.state0[f.state]),
        "unregistered": bool((record.counter("unregistered")[:s] > 0).any()),
        "drew-more": f.drawn is not None and int(mine.drawn[f.drawn]) == int(c.drawn[0][f.drawn]),
        "inputs-nonfinite": bool((record.counter("inputs_nonfinite")[:s] > 0).any()),
    }
    assert tuple(flags) == PREDICATES
    meta = rank_strings(
        record,
        first,
        window_sites=window_sites,
        shared_saves=shared_saves,
        scale=int(mine.scale[f.scale]) if f.scale is not None else 0,
        edited=first_set(synced.my_edits.tolist()),
    )
    return Evaluated(flags=flags, hidden=hidden, window_sites=window_sites, shared_saves=shared_saves, meta=meta)


@dataclass(frozen=True, slots=True)
class Named:
    """Round D read back."""

    examples: dict[str, Examples]
    """Per predicate: how many ranks, and up to `EXAMPLES` of them."""
    meta_len: int
    """The longest string any rank would send in round E."""
    hidden: torch.Tensor
    """bool[2, P]: `Hidden.params` on some rank."""
    hidden_steps: torch.Tensor
    """bool[2, pad_steps]."""
    hidden_crashed: list[int]
    """[2]: ranks whose mark-ready-twice crash is attributed to each kind."""
    edited_steps: torch.Tensor
    """bool[S]: steps in which some rank changed gradients after DDP reduced them."""
    gap: float
    """The largest weight difference from group rank 0's (0 when no weight differs)."""
    curve: Curve


def examples_from(counts: torch.Tensor, slots: torch.Tensor) -> dict[str, Examples]:
    out = {}
    for k, name in enumerate(PREDICATES):
        found = sorted(-int(v) for v in slots[k].tolist() if v != MIN)
        out[name] = Examples(count=int(counts[k]), ranks=found[:EXAMPLES])
    return out


def curve_of(keys: torch.Tensor, s: int, w_missing: torch.Tensor, g_missing: torch.Tensor) -> Curve:
    gaps = [unkey(int(k)) for k in keys.tolist()]
    return Curve(
        weights=gaps[: s + 1], grads=gaps[s + 1 :], weights_missing=w_missing.tolist(), grads_missing=g_missing.tolist()
    )


def name_ranks(
    mine: Evaluated, vs0: Rank0Slices, synced: Synced, weight_differs: bool, *, s: int, rank: int, world: int
) -> Generator[Op, Reply, Named]:
    """Round D's two collectives: the SUM, then the MAX."""
    d = SumRound(world)
    d.ints("counts", torch.tensor([int(v) for v in mine.flags.values()]))
    d.bits("hidden", mine.hidden.params)
    d.bits("hidden_steps", mine.hidden.steps)
    d.ints("hidden_crash", torch.tensor(mine.hidden.crashed))
    d.bits("w_missing", vs0.w_missing.any(-1))
    d.bits("g_missing", vs0.g_missing)
    d.bits("edited_steps", synced.my_edits)
    dm = MaxRound()
    me = torch.full((len(PREDICATES), SLOTS), MIN, dtype=torch.int64)
    for k, v in enumerate(mine.flags.values()):
        if v:
            me[k, rank % SLOTS] = -rank
    dm.slot("slots", me, True)
    dm.pair("meta_len", torch.tensor([len(mine.meta)]))
    dm.pair("gap", order_key(torch.tensor([vs0.gap])))
    dm.pair("curve", order_key(torch.cat([vs0.w_curve, vs0.g_curve])))
    rd = d.read((yield ("sum", d.tensor())))
    rdm = dm.read((yield ("max", dm.tensor())))
    return Named(
        examples=examples_from(rd["counts"], rdm["slots"]),
        meta_len=int(rdm["meta_len"][0][0]),
        hidden=rd["hidden"] > 0,
        hidden_steps=rd["hidden_steps"] > 0,
        hidden_crashed=[int(v) for v in rd["hidden_crash"]],
        edited_steps=rd["edited_steps"] > 0,
        gap=unkey(int(rdm["gap"][0][0])) if weight_differs else 0.0,
        curve=curve_of(rdm["curve"][0], s, rd["w_missing"] > 0, (rd["g_missing"] > 0).sum(-1)),
    )
