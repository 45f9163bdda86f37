"""A sharded model's facts in the shape every parallelism shares (`core/agreed.Agreed`), from its `ShardedRun`
(`from_run`; DDP's are `analyze/view_facts.py`'s). A sharded exchange reduces most facts to bounds over the ranks
and names the lowest rank, where DDP's keeps example ranks: the facts say which. Pure."""

from __future__ import annotations

from ddp_doctor.analyze.parallelism import optimizer_named, train_modes_apart
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
    WeightsApart,
)
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = ["from_run"]


def _drawn_apart_run(apart: HeldApart | None) -> DrawnApart | None:
    """The ranks whose count is not the reference rank's are named (never none of them); `held` maps a rank to
    (its batches drawn, the loader's line)."""
    if apart is None:
        return None
    (others, site), (drew, _) = apart.held[apart.reference], apart.held[apart.ranks[0]]
    return DrawnApart(apart.step, apart.ranks, apart.more, drew, others, site)


def _input_wait_run(run: ShardedRun) -> InputWait | None:
    """The sharded exchange sets `input_wait` only where every rank waited (`core/steptime.waits_for_data_at`)."""
    if not (w := run.input_wait):
        return None
    loader = w["loader"]
    return InputWait(
        waiting=run.world,
        measured=run.world,
        clock=w.get("clock", "host"),
        steps=w["steps"],
        wait_s=tuple(w["wait_s"]),
        step_s=tuple(w["step_s"]),
        loader=loader,
        sites=[loader.get("site") or ""],
        ranks=list(range(run.world)),
    )


def from_run(run: ShardedRun) -> Agreed:
    """A sharded model's: the exchange's reference rank holds the most common value (`exchange/oddranks.py`)."""
    modes = run.modes_apart if run.modes_apart is not None and train_modes_apart(run.modes_apart) else None
    grads = run.params_grads or []
    never = [ref for ref, trains, (had, _, _) in zip(run.params, run.params_trainable, grads) if trains and not had]
    return Agreed(
        parallelism=parallelism_of(run.sharding),
        world=run.world,
        framework=run.framework,
        # Only where the optimizer steps the model's parameters: otherwise nothing is meant to train.
        never_reached=NeverReached(never, run.steps, None) if never and run.model_params_stepped else None,
        device_type=(run.sharding or {}).get("device_type", ""),
        input_wait=_input_wait_run(run),
        inputs_compared=list(run.inputs_compared),
        inputs_identical=bool(run.inputs_identical),
        one_data_group=run.beside_groups == 1,
        settings_apart=run.settings_apart,
        metric_schedulers=list(run.metric_schedulers),
        modes_apart=modes,
        collectives_apart=run.collectives_apart,
        drawn_apart=_drawn_apart_run(run.drawn_apart),
        graph_collectives=list(run.graph_collectives),
        nonfinite=_nonfinite_run(run),
        moves=_moves_run(run),
        slowest=_slowest_run(run),
        # Only tensors no observed step gave a gradient: a tensor beside the model that gets them is in use.
        stale_optimizer=StaleOptimizer(
            stale=run.replaced,
            steps=run.steps,
            wholesale=True,
            optimizer=optimizer_named(run),
            model_params=run.model_params,
            moved=run.model_changed,
        )
        if run.replaced and not run.model_params_stepped
        else None,
        buffers_apart=_buffers_apart_run(run),
        samplers_apart=SamplersApart(
            {int(r): d for r, d in run.samplers_apart["held"].items() if d},
            list(run.samplers_apart["ranks"]),
            run.samplers_apart["more"],
        )
        if run.samplers_apart
        else None,
        weights_apart=_weights_apart_run(run),
    )


def _weights_apart_run(run: ShardedRun) -> WeightsApart | None:
    """The sharded exchange compares the replicas' local tensors after the first observed step and the last, and
    their sums after each step where the ranks measured them (`first_step`)."""
    if (apart := run.replicas_apart) is None:
        return None
    first = apart.get("first_step")
    hsdp = run.replica_rows > 1 or len((run.sharding or {}).get("mesh_dims") or []) > 1
    return WeightsApart(
        params=list(apart["params"]),
        reference=apart["reference"],
        ranks=list(apart["ranks"]),
        more=apart["more"],
        at_start=bool(apart["at_first"]),
        steps=[0] if apart["at_first"] else [first or run.steps - 1],
        first_step=first,
        observed=run.steps,
        row=apart["row"] if hsdp else None,
    )


def _buffers_apart_run(run: ShardedRun) -> list[BuffersApart]:
    """FSDP2 and `replicate` take parameters only: every buffer is each rank's own. Those that never changed
    differed from the first step on; those that changed (running statistics) are compared at the last."""
    apart = [(ref, moved) for ref, differ, moved in zip(run.buffers, run.buffers_differ, run.buffers_moved) if differ]
    ranks = list(range(run.world))
    made = [ref for ref, moved in apart if not moved]
    training = [ref for ref, moved in apart if moved]
    return [
        *([BuffersApart(buffers=made, steps=list(range(run.steps)), changing=False, ranks=ranks)] if made else []),
        *([BuffersApart(buffers=training, steps=[run.steps - 1], changing=True, ranks=ranks)] if training else []),
    ]


def _slowest_run(run: ShardedRun) -> Slowest | None:
    """The reduction carries bounds, not medians (`ShardedRun.slowest`): the longest of the other ranks' own work,
    the shortest of their times in collectives. Its extra time is between steps when at least half of it is."""
    if (s := run.slowest) is None:
        return None
    between = s["wait_s"] - s["others_wait_s"]
    outside = between >= 0.5 * (s["own_s"] - s["others_own_s"])
    return Slowest(
        rank=s["rank"],
        name=s["rank"],
        steps=s["steps"],
        own_s=s["own_s"],
        own_q=(s["own_q1_s"], s["own_q3_s"]),
        own_comm_s=s.get("comm_s", 0.0),
        others_s=s["others_own_s"],
        others_q3_s=s["others_own_q3_s"],
        lost_s=s["others_comm_s"],
        phase="data_wait" if outside else "step",
        phase_extra_s=between if outside else None,
        bounds=True,
    )


def _nonfinite_run(run: ShardedRun) -> NonFinite | None:
    """A sharded model's gradient shards are measured as one norm per rank and step: the steps they held NaN or
    infinity at, not in how many parameters; the lowest rank whose inputs did, not how many."""
    if not (steps := run.grads_nonfinite_steps):
        return None
    bad = run.inputs_nonfinite  # (the step, the lowest rank whose inputs held NaN or infinity)
    return NonFinite(
        grads_step=steps[0],
        steps=list(steps),
        inputs_step=bad[0] if bad is not None else None,
        inputs_ranks=[bad[1]] if bad is not None else [],
    )


def _moves_run(run: ShardedRun) -> Moves | None:
    """Measured only where the optimizer steps the model's parameters (else nothing it does moves them:
    `optimizer-params-replaced`'s) and no gradient shard held NaN or infinity (the weights' moves are measured over
    the whole run, not per step). The weights' moves are measured from the first step's end."""
    measured = run.grads_measured_steps
    if not measured or run.grads_nonfinite_steps or run.steps < 2 or not run.model_params_stepped:
        return None
    facts = zip(run.params, run.params_trainable, run.params_grads or [], run.params_held, run.params_zero_lr)
    never = [
        (ref, held, zero) for ref, trains, (_, nonzero, moved), held, zero in facts if trains and nonzero and not moved
    ]
    return Moves(
        steps=list(measured),
        all_zero=measured == run.grads_zero_steps,
        moved=run.model_changed,
        rates=list(run.learning_rates),
        never=[ref for ref, _, _ in never],
        never_held=sum(held for _, held, _ in never),
        never_zero_lr=sum(zero for _, _, zero in never),
        never_steps=list(range(1, run.steps)),
        optimizer=optimizer_named(run),
    )
