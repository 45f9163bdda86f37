"""DDP's facts in the shape every parallelism shares (`core/agreed.Agreed`), from its `View` of the exchanged
`Summary` (`from_view`; a sharded model's are `analyze/run_facts.py`'s). The detectors registered for every road
read only that shape, so what they decide is decided once. Pure."""

from __future__ import annotations

import torch

from ddp_doctor.analyze.buffer_state import late_apart
from ddp_doctor.analyze.common import all_ranks, first_differing, meta_sites, steps_of
from ddp_doctor.analyze.epochs import training_loader
from ddp_doctor.analyze.local_sgd import local_sgd
from ddp_doctor.analyze.throughput import gpu_timed, host_times_tell
from ddp_doctor.analyze.tree_digest import modes_parted, param_entry, step_apart
from ddp_doctor.analyze.view import View
from ddp_doctor.core.agreed import (
    Agreed,
    BuffersApart,
    DrawnApart,
    HeldApart,
    InputWait,
    Moves,
    NeverReached,
    NonFinite,
    SamplersApart,
    Slowest,
    StaleOptimizer,
    SteppedApart,
    WeightsApart,
)
from ddp_doctor.core.codes import Code
from ddp_doctor.core.steptime import PHASES

__all__ = ["from_view"]


def from_view(v: View) -> Agreed:
    """DDP's: the ranks named are group rank 0 and the example ranks the exchange kept for each difference."""
    s = v.summary
    compared = steps_of(s.input_present) if v.steps else []
    identical = bool(compared) and not bool(s.input_differs[s.input_present].any())
    return Agreed(
        parallelism="ddp",
        world=v.world,
        framework=v.info.framework,
        flavor=v.info.flavor,
        ddp_flags=dict(v.info.ddp_config),
        never_reached=_never_reached(v),
        device_type=v.info.device_type,
        input_wait=_input_wait(v),
        inputs_compared=compared,
        inputs_identical=identical,
        settings_apart=_settings_apart(v),
        scheduler_apart=_scheduler_apart(v),
        schedulers_counted=True,
        metric_schedulers=list(v.meta(0).get("metric_schedulers") or []),
        modes_apart=_modes_apart(v),
        **_collectives_apart(v),
        drawn_apart=_drawn_apart(v),
        graph_collectives=list(v.meta(0).get("graph_collectives") or []),
        nonfinite=_nonfinite(v),
        moves=_moves(v),
        slowest=_slowest(v),
        stale_optimizer=_stale_optimizer(v),
        buffers_apart=_buffers_apart(v),
        samplers_apart=_samplers_apart(v),
        weights_apart=_weights_apart(v),
        local_averaging=local_sgd(v),
        grads_measured=dict(s.grads_measured),
    )


def _weights_apart(v: View) -> WeightsApart | None:
    """DDP's exchange compares the weights' digests before every step (`weight_steps`, [S + 1]: the first at
    the observation's start): apart at step k is apart after step k - 1."""
    params = v.summary.weight_params
    if v.world < 2 or not params.any():
        return None
    after = [s - 1 for s in steps_of(v.summary.weight_steps) if s > 0]
    others = v.ranks("weight-differs")
    return WeightsApart(
        params=v.params(params),
        reference=0,
        ranks=others.ranks,
        more=others.more,
        at_start=bool(v.summary.weight_steps[0]),
        steps=after,
        first_step=after[0] if after else None,
        observed=v.steps,
        gap=v.summary.weight_gap,
    )


def _samplers_apart(v: View) -> SamplersApart | None:
    """The ranks DDP's exchange named by its predicate "sampler-apart"; rank 0 and the first other rank named are
    the only ones whose loaders it sent."""
    odd = v.ranks("sampler-apart")
    if v.world < 2 or not odd.count:
        return None
    chosen = [0, *[r for r in odd.ranks if r != 0][:1]]
    held = {r: training_loader(v.meta(r)) for r in chosen if r in v.summary.metas}
    return SamplersApart(held, odd.ranks, odd.more)


_PRESENT, _ZERO, _NONFINITE, _MOVED, _W_NONFINITE, _INPUTS = range(6)
"""The columns of DDP's exchanged `Summary.moves` (`StepCounters`): per step, the most over the ranks of the
parameters with a gradient, with an all-zero one, with a non-finite one, whose weights moved, whose weights are
non-finite, and whether the rank's inputs were."""


def _first(mask: torch.Tensor) -> int | None:
    hits = mask.nonzero().flatten().tolist()
    return hits[0] if hits else None


def _nonfinite(v: View) -> NonFinite | None:
    """The steps' most non-finite gradients and weights over the ranks; under a GradScaler a step with non-finite
    gradients is skipped by design, so only the weights count there. The ranks whose own batches held NaN or
    infinity at or before the first bad step are where it came from."""
    moves, before = v.summary.moves, v.summary.nonfinite_before
    if moves is None or not v.steps:
        return None
    m = moves[0][: v.steps]
    scaled = torch.tensor([bool(s) for s in v.summary.scales[0][: v.steps]], dtype=torch.bool)
    grad_step = _first((m[:, _NONFINITE] > 0) & ~scaled)
    weight_step = _first(m[:, _W_NONFINITE] > 0)
    if grad_step is None and weight_step is None and not before:
        return None
    input_step = _first(m[:, _INPUTS] > 0) if m.shape[1] > _INPUTS else None
    broke = min((s for s in (grad_step, weight_step) if s is not None), default=v.steps)
    fed = v.ranks("inputs-nonfinite") if input_step is not None and input_step <= broke else None
    fed = fed if fed is not None and fed.count else None
    positions = v.meta(0).get("nonfinite_params", [])
    return NonFinite(
        grads_step=grad_step,
        grads_count=None if grad_step is None else int(m[grad_step, _NONFINITE]),
        weights_step=weight_step,
        weights_count=0 if weight_step is None else int(m[weight_step, _W_NONFINITE]),
        before=before,
        steps=sorted({s for s in (grad_step, weight_step) if s is not None}),
        params=v.params([i for i in positions if i < len(v.info.param_names)]),
        materialised=list(v.meta(0).get("to_empty_sites", [])),
        inputs_step=input_step if fed is not None else None,
        inputs_ranks=list(fed.ranks) if fed is not None else [],
        inputs_more=fed.more if fed is not None else 0,
        inputs_count=fed.count if fed is not None else None,
    )


def _moves(v: View) -> Moves | None:
    """The optimizer steps taken whose gradients and weights were finite on every rank."""
    moves = v.summary.moves
    if moves is None or not v.steps:
        return None
    m = moves[0][: v.steps]
    stepped = torch.tensor([bool(x) for x in v.summary.steps_taken[0][: v.steps]], dtype=torch.bool)
    finite = (m[:, _NONFINITE] == 0) & (m[:, _W_NONFINITE] == 0)
    measured = stepped & finite & (m[:, _PRESENT] > 0)
    if not measured.any():
        return None
    steps = measured.nonzero().flatten().tolist()
    meta = v.meta(0)
    return Moves(
        steps=steps,
        all_zero=bool((m[measured, _ZERO] == m[measured, _PRESENT]).all()),
        moved=bool((m[measured, _MOVED] > 0).any()),
        rates=list(meta.get("learning_rates", [])),
        never=v.params([i for i in meta.get("never_updated", []) if i < len(v.info.param_names)]),
        never_held=int(meta.get("never_updated_held", 0)),
        never_zero_lr=int(meta.get("never_updated_zero_lr", 0)),
        never_steps=steps,
    )


def _buffers_apart(v: View) -> list[BuffersApart]:
    """The buffers DDP was built with that differed at some step's forward (`buffer_fp`), split into those made
    different and those that change in training; and those registered after DDP was built that it does not
    broadcast (`late_apart`), with the ranks whose module tree differs from rank 0's."""
    if v.world < 2 or not v.steps:
        return []
    differ = v.summary.buffer_differs & v.summary.buffer_seen  # [S, B]: every rank recorded it, and they differ
    changing = set(v.meta(0).get("buffers_changing") or [])
    apart = differ.any(0)
    moving = apart & differ.new_tensor([i in changing for i in range(len(apart))], dtype=torch.bool)
    found = [
        BuffersApart(
            buffers=v.buffers(mask), steps=steps_of(differ[:, mask].any(1)), changing=running, ranks=all_ranks(v)
        )
        for mask, running in ((apart & ~moving, False), (moving, True))
        if mask.any()
    ]
    if late := late_apart(v):
        entries, running = late
        found.append(
            BuffersApart(
                buffers=[param_entry(e) for e in entries],
                steps=[step_apart(v, "late_buffers")[0]],
                changing=running,
                ranks=sorted({0, *v.ranks("state-differs").ranks}),
                late=True,
                registered_at=sorted({e["site"] for e in entries if e.get("site")}),
                # The flag is on, yet DDP had no buffers when it was built: it syncs none.
                none_at_wrap=bool(v.info.ddp_config.get("broadcast_buffers", True)) and not v.info.buffers_synced,
            )
        )
    return found


def _stale_optimizer(v: View) -> StaleOptimizer | None:
    """Rank 0's optimizer holds tensors the module tree no longer does: the old parameters a replaced module left
    in DDP's reducer, and the replacements no optimizer steps."""
    stale = int(v.meta(0).get("optimizer_stale", 0) or 0)
    if not stale or not v.steps:
        return None
    return StaleOptimizer(
        stale=stale,
        steps=v.steps,
        params=v.params(v.orphaned),
        replacements=[e["name"] for e in v.meta(0).get("unregistered", []) if e.get("stepped") is False],
    )


def _slowest(v: View) -> Slowest | None:
    """DDP's exchange carries the slowest rank's phases whole and the other ranks' medians; its extra time goes
    to the phase it is longest in against them."""
    st = v.summary.step_times
    if not host_times_tell(v) or st.measured < 2 or (others := st.others_median) is None or st.others_q3_max is None:
        return None
    if (slow := next((t for t in st.shown if t.rank == st.slowest), None)) is None:
        return None
    gaps = {p: slow.median[p] - others[p] for p in PHASES if p != "comm_wait_s"}
    phase = max(gaps, key=lambda p: gaps[p])
    group = v.info.group_ranks
    return Slowest(
        rank=slow.rank,
        name=group[slow.rank] if group and slow.rank < len(group) else slow.rank,  # as users number them
        steps=st.steps,
        own_s=slow.own_s,
        own_q=(slow.own_q1_s, slow.own_q3_s),
        own_comm_s=slow.median.get("comm_wait_s", 0.0),
        others_s=others["own_s"],
        others_q3_s=st.others_q3_max,
        lost_s=others["comm_wait_s"],
        phase=phase.removesuffix("_s"),
        phase_extra_s=gaps[phase],
    )


def _input_wait(v: View) -> InputWait | None:
    """The waits the ranks' step tables show, on the GPU's clock where every rank timed one, else on the host's
    where it tells them (a CPU model); None without a DataLoader iterated while observed (the time between steps
    is then the loop's own, not a wait for data)."""
    gpu = gpu_timed(v)
    st, loaders = v.summary.step_times, v.meta(0).get("loaders", [])
    if (not gpu and not host_times_tell(v)) or not st.measured or not loaders or st.waiting_median is None:
        return None
    wait, step, named = st.waiting_median["data_wait_s"], st.waiting_median["step_s"], list(st.waiting_ranks or [])
    return InputWait(
        waiting=st.waiting,
        measured=st.measured,
        clock="gpu" if gpu else "host",
        steps=st.waiting_steps,
        wait_s=(wait, wait),
        step_s=(step, step),
        compute_s=st.waiting_median["compute_s"],
        loader=next((x for x in loaders if x.get("batches") is not None), loaders[0]),
        sites=[d.get("site") or "" for d in loaders],
        ranks=named,
        more=st.waiting - len(named),
    )


def _never_reached(v: View) -> NeverReached | None:
    """Parameters whose modules never ran in a training forward and that got no gradient (a module that ran is
    `grad-blocked`'s); not those a replaced module left in DDP's reducer (`unregistered-parameters` says so)."""
    if not v.steps:
        return None
    never, _ = v.unused_by_cause()
    never = never & ~v.orphaned
    return NeverReached(v.params(never), v.steps, modules_ran=False) if never.any() else None


def _settings_apart(v: View) -> HeldApart | None:
    step = v.summary.optimizer_differs
    if step is None:
        return None
    odd = v.ranks(Code.OPTIMIZER_DIFFERS)
    held = {r: (v.meta(r).get("optimizer") or [""])[0] for r in [0, *odd.ranks]}
    return HeldApart(step, 0, held, odd.ranks, odd.more)


def _scheduler_apart(v: View) -> SteppedApart | None:
    """An LR scheduler stepped on some ranks only, at or before the step whose optimizer settings differ."""
    step = v.summary.optimizer_differs
    changed = [k for k in first_differing(v.summary.scheduler_steps) if step is not None and k <= step]
    if not changed:
        return None
    extra = v.ranks("scheduler-extra")
    return SteppedApart(changed[0], extra.ranks, extra.more, meta_sites(v, extra.ranks, "scheduler_sites"))


def _modes_apart(v: View) -> HeldApart | None:
    parted = modes_parted(v)
    if parted is None:
        return None
    step, held = parted
    return HeldApart(step, 0, held, sorted(r for r in held if r != 0))


def _collectives_apart(v: View) -> dict:
    """The first step whose script collectives differed (their count and running digest), the calls of rank 0 and
    of the example ranks that differ, the fewest and most calls then, and the later steps that differed too."""
    if v.world < 2 or not v.steps:
        return {}
    hi, lo = v.summary.collectives
    bad = [s for s in range(v.steps) if bool((hi[s] != lo[s]).any())]
    if not bad:
        return {}
    first, odd = bad[0], v.ranks("collective-differs")
    calls = {r: v.meta(r)["collective_log"] for r in [0, *odd.ranks]}  # the exchange kept that step's calls
    return {
        "collectives_apart": HeldApart(first, 0, calls, odd.ranks, odd.more),
        "collectives_counts": sorted({int(lo[first][0]), int(hi[first][0])}),
        "collectives_also": bad[1:],
    }


def _drawn_apart(v: View) -> DrawnApart | None:
    """The ranks at the MAX of the first step whose batches drawn differ are named."""
    k = v.summary.drawn_step
    if v.world < 2 or k is None:
        return None
    more, loader = v.ranks("drew-more"), training_loader(v.meta(0))
    drew, others = v.summary.drawn[0][k], v.summary.drawn[1][k]
    return DrawnApart(k, more.ranks, more.more, drew, others, loader.get("site") or loader.get("iterated_at"))
