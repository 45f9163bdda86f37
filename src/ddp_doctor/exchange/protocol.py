"""One rank's side of the check's exchange: the rounds in order, each in its own module with what it puts in and
what it reads back, and the `Summary` assembled from their results.

| round | module | collectives | puts | reads back |
|---|---|---|---|---|
| A | common_steps.py | MAX (+ SUM when the ModelInfos differ, + SUM and MAX when the trainable sets at the wrap differ) | step counts, ModelInfo and trainable-set digests | `Agreed` |
| B | facts.py, compared.py | MAX, SUM | digests and per-step counters; bit planes | `Compared`, `Counted` |
| B2 | step_grads.py | MAX, if requires_grad differs by rank | grad digests, masked by what all train | `GradDigests` |
| B3 | step_grads.py | MAX, when some gradient differs at the step | digests after DDP's all-reduce | `Synced` |
| C | rank0_slices.py | MAX, SUM, if grads or weights differ | differing slices, rank 0's fingerprints | `Rank0Slices` |
| D | predicates.py | SUM, MAX | predicates, hidden parameters, the curve | `Named` |
| usage map | patterns.py | MAX; if grids differ, MAX and SUM per pattern, SUM | the rank's usage grid | patterns |
| E | strings.py | SUM | the strings of the example ranks | metas |
| T | timing.py | 16 SUMs (none without a common step) | histograms of digits | the medians |
| P | ranktable.py | MAX, MAX, SUM, MAX, 16 SUMs | the rank's phases | `StepTimes` |

Every collective's op and shape depend only on (W, S, P, B) and on earlier results, which every rank holds
identically: never on local data (docs/architecture.md, "Rules that hold everywhere").
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from ddp_doctor.core.records import ModelInfo, RankRecord
from ddp_doctor.core.steptime import StepTimes
from ddp_doctor.core.summary import Summary
from ddp_doctor.exchange.common_steps import Agreed, agree_steps
from ddp_doctor.exchange.compared import FirstSteps, grad_hashes
from ddp_doctor.exchange.facts import Facts, exchange_facts
from ddp_doctor.exchange.packing import MIN, Op, Reply
from ddp_doctor.exchange.patterns import patterns, usage_grid
from ddp_doctor.exchange.predicates import Named, evaluate, name_ranks
from ddp_doctor.exchange.rank0_slices import against_rank0
from ddp_doctor.exchange.ranktable import per_rank
from ddp_doctor.exchange.step_grads import Differing, Synced, differing, edited_after_sync, masked_by_trained
from ddp_doctor.exchange.strings import example_metas
from ddp_doctor.exchange.timing import medians

__all__ = ["protocol"]


def protocol(record: RankRecord, info: ModelInfo, *, rank: int, world: int) -> Generator[Op, Reply, Summary]:
    """One rank's side of the exchange (group ranks). Yields collectives, returns the `Summary`."""
    agreed = yield from agree_steps(record, info, rank=rank)  # A
    info, s = agreed.info, agreed.steps
    ignored = torch.tensor(info.ignored, dtype=torch.bool)
    facts = yield from exchange_facts(record, agreed, ignored=ignored, rank=rank, world=world)  # B
    grads = yield from masked_by_trained(record, facts, s=s, ignored=ignored, world=world)  # B2
    differ = differing(facts, grads, info, s=s, world=world)
    synced = yield from edited_after_sync(record, grads, differ.grad_params, s=s)  # B3
    first = FirstSteps.of(facts.compared)
    vs0 = yield from against_rank0(  # C
        record,
        s,
        grad_params=differ.grad_params,
        weight_params=differ.weight_params,
        trained_by_all=facts.counted.trainable == world,
        grad_hashes=lambda: grad_hashes(record, s),
        rank=rank,
    )
    mine = evaluate(record, agreed, facts, first, differ, vs0, synced, rank=rank, world=world)
    named = yield from name_ranks(mine, vs0, synced, bool(differ.weight_params.any()), s=s, rank=rank, world=world)  # D
    grid = usage_grid(record, info, differ.tracked, s)
    usage = yield from patterns(grid, rank=rank, world=world)  # the usage map
    metas = yield from example_metas(named.examples, mine.meta, named.meta_len, rank=rank)  # E
    timing = yield from medians(record, s, world)  # T
    phases = yield from per_rank(record, s, rank, world)  # P
    return _summary(agreed, facts, first, differ, synced, named, usage, metas, timing, phases, world=world)


def _summary(
    agreed: Agreed,
    facts: Facts,
    first: FirstSteps,
    differ: Differing,
    synced: Synced,
    named: Named,
    usage: tuple[list[torch.Tensor], list[list[int]], list[int]],
    metas: dict[int, dict[str, Any]],
    timing: list[float | None],
    phases: StepTimes,
    *,
    world: int,
) -> Summary:
    """The group's `Summary` from the rounds' results."""
    s, b, c, tracked = agreed.steps, facts.counted, facts.compared, differ.tracked
    n_wins = int(c.n_windows[1][0])
    w_hi, w_lo = c.windows
    u_hi, u_lo = c.unpaired
    sc_hi, sc_lo = c.scale
    st_hi, st_lo = c.stepped
    sy_hi, sy_lo = c.synced
    sh_hi, sh_lo = c.sched
    ch_hi, ch_lo = c.changed
    rr_hi, rr_lo = c.rereduced
    big, small = int(c.batch_size[0][0]), int(c.batch_size[1][1])
    grids, members, omitted = usage
    return Summary(
        info=agreed.info,
        wrap_trainable=agreed.wrap_trainable,
        world=world,
        steps=s,
        pad_steps=agreed.pad_steps,
        used=b.used,
        trainable=b.trainable,
        ran=b.ran > 0,
        partial=b.partial > 0,
        varies=b.varies > 0,
        after_crash=b.after_crash > 0,
        bypass_used=b.bypass_used > 0,
        bypass_steps=b.bypass_steps > 0,
        no_trainable_steps=(b.empty > 0)[:s],
        reduction_missing=(b.missing > 0) & tracked,
        rank0_trainable=b.rank0_trainable > 0,
        tracked=tracked,
        crash_steps=b.crash_steps > 0,
        hidden=named.hidden,
        hidden_steps=named.hidden_steps,
        hidden_crashed=named.hidden_crashed,
        grad_params=differ.grad_params,
        grad_steps=differ.grad_steps,
        edited_params=synced.edited,
        edited_steps=named.edited_steps,
        grads_measured=metas[0].get("grads_measured", {}),
        unsynced=differ.unsynced,
        weight_params=differ.weight_params,
        weight_steps=differ.weight_steps,
        weight_gap=named.gap,
        buffer_seen=b.buffer_nan == 0,
        buffer_differs=c.buffer[0] != c.buffer[1],
        input_present=b.input == world,
        input_differs=c.input[0] != c.input[1],
        windows=n_wins,
        window_passes=(w_hi[:n_wins].tolist(), w_lo[:n_wins].tolist()),
        loader_ranks=int(b.loader[0]),
        batches=(int(c.batches[0][0]), int(c.batches[1][0])),
        padded=int(c.padded[0]),
        first_batches=[int(v) for v in c.first_batches],
        examples=named.examples,
        metas=metas,
        timing=timing,
        step_times=phases,
        unpaired=(u_hi.tolist(), u_lo.tolist()),
        broadcasts=c.bcast,
        collectives=c.coll,
        collectives0=c.coll0,
        scales=(sc_hi.tolist(), sc_lo.tolist()),
        scales0=c.scale0.tolist(),
        steps_taken=(st_hi.tolist(), st_lo.tolist()),
        synced=(sy_hi.tolist(), sy_lo.tolist()),
        optimizer_differs=first.settings,
        scheduler_steps=(sh_hi.tolist(), sh_lo.tolist()),
        changed=(ch_hi.tolist(), ch_lo.tolist()),
        rereduced=(rr_hi.tolist(), rr_lo.tolist()),
        split_passes=c.passes[0][:, 0].tolist(),
        inner_passes=c.passes[0][:, 1].tolist(),
        batchnorm_training=b.bn_training > 0,
        batch_sizes=(big, small) if big != MIN else None,
        patterns=list(zip(grids, members)),
        patterns_omitted=omitted,
        curve=named.curve,
        state_step=first.state,
        unregistered=c.unregistered[0].tolist(),
        moves=c.moves,
        nonfinite_before=int(c.nonfinite_before[0][0]),
        drawn=(c.drawn[0].tolist(), c.drawn[1].tolist()),
        drawn_step=first.drawn,
        sampler_compared=int(c.sampler[0][0]) != MIN,
    )
