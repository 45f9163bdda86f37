"""The concepts DDP, FSDP2 and `replicate` share are decided once, from the same typed facts (`core/agreed.py`):
DDP's exchanged `Summary` and a sharded model's `ShardedRun` give equal `Agreed` facts for the same evidence, and one
detector (`road="every"`) makes the same finding of them, its parallelism changing only the consequence it words."""

from __future__ import annotations

import torch
from purerecords import ALL, info, record

from ddp_doctor.analyze.buffer_state import buffer_divergence
from ddp_doctor.analyze.collective_order import collective_sequence_mismatch
from ddp_doctor.analyze.moves import nonfinite_values, training_stalled
from ddp_doctor.analyze.optimizer_settings import optimizer_differs
from ddp_doctor.analyze.replica_state import modes_differ, replica_divergence
from ddp_doctor.analyze.run_facts import from_run
from ddp_doctor.analyze.shards import shards_overlap
from ddp_doctor.analyze.stragglers import straggler_rank
from ddp_doctor.analyze.used_set import unused_parameters
from ddp_doctor.analyze.view import View
from ddp_doctor.analyze.view_facts import from_view
from ddp_doctor.core.agreed import (
    Agreed,
    BuffersApart,
    HeldApart,
    Moves,
    NeverReached,
    NonFinite,
    SamplersApart,
    Slowest,
    WeightsApart,
)
from ddp_doctor.core.findings import ParamRef
from ddp_doctor.core.records import StepCounters
from ddp_doctor.core.sharded_run import ShardedRun
from ddp_doctor.exchange import summarize

_SETTINGS = {0: "group 0 (4 tensors) lr=0.05, momentum=0.9", 1: "group 0 (4 tensors) lr=0.1, momentum=0.9"}


def _counters(rows: list[dict]) -> torch.Tensor:
    base = {"ddp_forwards": 1, "micro_steps": 1, "synced_backwards": 1, "optimizer_step": 1, "optimizer_digest": 7}
    return torch.tensor([StepCounters(**{**base, **row}).as_list() for row in rows])


def _ddp_view() -> View:
    """Two ranks whose optimizer's learning rate parts at step 1, after rank 0 alone stepped a StepLR."""
    rows0, rows1 = _counters([{}, {"scheduler_steps": 1}, {}]), _counters([{}, {"optimizer_digest": 9}, {}])
    r0, r1 = record(0, ALL, counters=rows0), record(1, ALL, counters=rows1)
    r0.optimizer_log = [f"step {s}: {_SETTINGS[0] if s else _SETTINGS[1]}" for s in range(3)]
    r1.optimizer_log = [f"step {s}: {_SETTINGS[1]}" for s in range(3)]
    r0.scheduler_sites = ["step 1: StepLR.step() at train.py:31"]
    return View(summarize(info(), [r0, r1]))


def _sharded_run(api: str, **facts) -> ShardedRun:
    sharding = {"api": api, "root_sharded": True}
    return ShardedRun(
        world=2, steps=3, optimizer="SGD", optimizer_site=None, sharding=sharding, model_params=4, **facts
    )


def test_settings_apart_reach_the_detector_in_one_shape_from_either_road() -> None:
    ddp = from_view(_ddp_view())
    assert ddp.settings_apart == HeldApart(step=1, reference=0, held=_SETTINGS, ranks=[1], more=0)
    assert (ddp.scheduler_apart.step, ddp.scheduler_apart.ranks) == (1, [0])
    assert ddp.scheduler_apart.sites == ["StepLR.step() at train.py:31"] and ddp.schedulers_counted
    sharded = from_run(_sharded_run("fully_shard", settings_apart=HeldApart(1, 0, dict(_SETTINGS), [1])))
    assert (sharded.parallelism, sharded.settings_apart) == ("fsdp2", ddp.settings_apart)
    assert sharded.scheduler_apart is None and not sharded.schedulers_counted  # not counted there, not "none"


def test_one_detector_names_settings_apart_alike_for_every_parallelism() -> None:
    apart = HeldApart(step=1, reference=0, held=_SETTINGS, ranks=[1], more=3)
    found = {}
    for parallelism in ("ddp", "fsdp2", "replicate"):
        (f,) = optimizer_differs(Agreed(parallelism=parallelism, world=8, settings_apart=apart))
        found[parallelism] = f
        measured = {m.name: m.value for m in f.measured}
        assert (f.code, f.severity, f.ranks, f.steps, f.more_ranks) == ("optimizer-differs", "error", [0, 1], [1], 3)
        assert measured == {"group 0 lr (rank 0)": 0.05, "group 0 lr (rank 1)": 0.1}
    assert found["ddp"].detail != found["fsdp2"].detail  # the consequence is the parallelism's: a shard apart
    assert optimizer_differs(Agreed(parallelism="ddp", world=1, settings_apart=apart)) == []


def test_a_scheduler_stepped_on_some_ranks_only_is_the_cause_it_names_with_its_call_and_line() -> None:
    (f,) = optimizer_differs(from_view(_ddp_view()))
    assert (f.ranks, f.steps, f.sites, f.labels) == ([0, 1], [1], ["train.py:31"], {"call": "StepLR.step()"})
    metric = Agreed(
        parallelism="fsdp2", world=2, settings_apart=HeldApart(1, 0, _SETTINGS, [1]), metric_schedulers=["train.py:40"]
    )
    (f,) = optimizer_differs(metric)
    assert (f.sites, f.labels) == (["train.py:40"], {"call": "ReduceLROnPlateau.step()"})


def test_modes_apart_name_the_reference_and_the_ranks_apart_with_the_count_beyond() -> None:
    held = {1: {"training": True}, 0: {"training": False}}
    for parallelism in ("ddp", "fsdp2"):
        agreed = Agreed(parallelism=parallelism, world=6, modes_apart=HeldApart(5, 1, held, [0], 2))
        (f,) = modes_differ(agreed)
        assert (f.code, f.severity, f.ranks, f.steps, f.more_ranks) == ("replica-divergence", "warning", [0, 1], [5], 2)
    # Only the frozen set apart (`param-shapes-differ`'s), not the train/eval modes: nothing here.
    frozen = HeldApart(5, 0, {0: {"frozen": []}, 1: {"frozen": ["a"]}}, [1])
    assert from_run(_sharded_run("replicate", modes_apart=frozen)).modes_apart is None


def test_a_steps_collectives_apart_name_the_first_step_and_for_ddp_the_later_ones() -> None:
    calls = {0: ["all_reduce(float32[1], SUM)/2 at train.py:50"], 1: ["broadcast(float32[4])/2 at train.py:52"]}
    apart = HeldApart(2, 0, calls, [1])
    (sharded,) = collective_sequence_mismatch(Agreed(parallelism="replicate", world=2, collectives_apart=apart))
    assert (sharded.ranks, sharded.steps, sharded.labels["kind"]) == ([0, 1], [2], "sequence")
    assert sharded.sites == ["train.py:50", "train.py:52"]
    ddp = Agreed(parallelism="ddp", world=2, collectives_apart=apart, collectives_counts=[1], collectives_also=[3])
    (f,) = collective_sequence_mismatch(ddp)
    assert (f.ranks, f.steps, f.sites) == ([0, 1], [2, 3], sharded.sites)


def test_parameters_nothing_reaches_are_an_error_only_where_ddp_waits_for_them() -> None:
    """The parallelism and DDP's flags decide the verdict; the parameters, ranks and steps are the same."""
    head = NeverReached([ParamRef("head.weight", 8, (2, 4))], steps=3, modules_ran=False)
    verdicts = {}
    for parallelism, flags in (("ddp", {}), ("ddp", {"static_graph": True}), ("fsdp2", {}), ("replicate", {})):
        agreed = Agreed(parallelism=parallelism, world=4, ddp_flags=flags, never_reached=head)
        (f,) = unused_parameters(agreed)
        assert (f.code, f.param_names, f.ranks, f.steps) == (
            "unused-parameters",
            ["head.weight"],
            [0, 1, 2, 3],
            [0, 1, 2],
        )
        verdicts[parallelism, bool(flags)] = f.severity
    assert verdicts == {
        ("ddp", False): "error",  # DDP waits for their gradients: the next step fails
        ("ddp", True): "warning",
        ("fsdp2", False): "warning",
        ("replicate", False): "warning",
    }
    assert unused_parameters(Agreed(parallelism="fsdp2", world=4)) == []


def test_a_sharded_models_parameters_no_step_gave_a_gradient_are_never_reached_only_if_the_model_is_stepped() -> None:
    refs = [ParamRef("a", 4), ParamRef("b", 4)]
    facts = {
        "params": refs,
        "params_trainable": [True, True],
        "params_grads": [(True, True, True), (False, False, False)],
    }
    assert from_run(_sharded_run("fully_shard", model_params_stepped=2, **facts)).never_reached == NeverReached(
        [refs[1]], steps=3, modules_ran=None
    )
    assert from_run(_sharded_run("fully_shard", model_params_stepped=0, **facts)).never_reached is None


def test_gradients_of_nan_are_seen_at_their_first_step_alike_by_every_road() -> None:
    """DDP counts the parameters per step; a sharded model measures one norm per rank, so it gives the steps and the
    lowest rank whose inputs held NaN, not how many parameters or ranks."""
    nan = {"grads_present": 4, "grads_nonfinite": 2, "weights_nonfinite": 2, "inputs_nonfinite": 1}
    fine = {"grads_present": 4, "weights_moved": 4}
    r0 = record(0, ALL, counters=_counters([fine, {**nan, "inputs_nonfinite": 0}, {**nan, "inputs_nonfinite": 0}]))
    r1 = record(1, ALL, counters=_counters([fine, nan, nan]))
    for r in (r0, r1):
        r.nonfinite_params = [0, 1]
    ddp = from_view(View(summarize(info(), [r0, r1]))).nonfinite
    assert (ddp.grads_step, ddp.grads_count, ddp.weights_step, ddp.weights_count, ddp.steps) == (1, 2, 1, 2, [1])
    assert (ddp.inputs_step, ddp.inputs_ranks, ddp.inputs_count) == (1, [1], 1)
    assert [p.name for p in ddp.params] == [info().param_names[0], info().param_names[1]]
    sharded = from_run(_sharded_run("fully_shard", grads_nonfinite_steps=[1, 2], inputs_nonfinite=(1, 1)))
    assert sharded.nonfinite == NonFinite(grads_step=1, steps=[1, 2], inputs_step=1, inputs_ranks=[1])
    for parallelism in ("ddp", "fsdp2", "replicate"):
        agreed = Agreed(parallelism=parallelism, world=4, nonfinite=sharded.nonfinite)
        (f,) = nonfinite_values(agreed, frozenset())
        measured = {m.name: m.value for m in f.measured}
        assert (f.code, f.severity, f.ranks, f.steps) == ("non-finite-values", "error", [0, 1, 2, 3], [1, 2])
        assert measured == {"first_rank_with_nonfinite_inputs": 1, "step_of_nonfinite_inputs": 1}
    # A sharded optimizer that steps other tensors than the model's measures those: that finding says why.
    replaced = Agreed(parallelism="fsdp2", world=4, nonfinite=sharded.nonfinite)
    assert nonfinite_values(replaced, frozenset({"optimizer-params-replaced"})) == []


def test_weights_that_never_move_are_one_verdict_whatever_the_parallelism() -> None:
    zero = Moves(steps=[0, 1, 2], all_zero=True, moved=False, rates=[0.1])
    lr0 = Moves(steps=[0, 1, 2], all_zero=False, moved=False, rates=[0.0])
    head = [ParamRef("head.weight", 8, (2, 4))]
    some = Moves(steps=[0, 1, 2], all_zero=False, moved=True, never=head, never_held=0, never_steps=[1, 2])
    for parallelism in ("ddp", "fsdp2", "replicate"):
        for moves, severity, measured in (
            (zero, "error", {"steps_with_all_gradients_zero": 3, "largest_learning_rate": 0.1}),
            (lr0, "error", {"steps_with_all_gradients_zero": 0, "largest_learning_rate": 0.0}),
        ):
            (f,) = training_stalled(Agreed(parallelism=parallelism, world=2, moves=moves), frozenset())
            assert (f.code, f.severity, f.ranks, f.steps) == ("training-stalled", severity, [0, 1], [0, 1, 2])
            assert {m.name: m.value for m in f.measured} == measured
        (f,) = training_stalled(Agreed(parallelism=parallelism, world=2, moves=some), frozenset())
        assert (f.severity, f.param_names, f.steps) == ("warning", ["head.weight"], [1, 2])
        assert {m.name: m.value for m in f.measured}["held_by_the_optimizer"] == 0
        # One warm-up step is not a stall; the cause another finding names is its own.
        one = Agreed(parallelism=parallelism, world=2, moves=Moves(steps=[0], all_zero=True, moved=False))
        assert training_stalled(one, frozenset()) == []
        explained = Agreed(parallelism=parallelism, world=2, moves=zero)
        assert training_stalled(explained, frozenset({"optimizer-params-replaced"})) == []
    low = Agreed(parallelism="fsdp2", world=2, moves=some)
    assert training_stalled(low, frozenset({"low-precision-weights"})) == []


def test_a_sharded_models_moves_are_measured_only_where_its_optimizer_steps_the_model_and_nothing_was_nan() -> None:
    facts = {
        "grads_measured_steps": [0, 1, 2],
        "grads_zero_steps": [0, 1, 2],
        "model_changed": False,
        "learning_rates": [0.1],
        "model_params_stepped": 4,
    }
    moves = from_run(_sharded_run("replicate", **facts)).moves
    assert (moves.steps, moves.all_zero, moves.moved, moves.rates) == ([0, 1, 2], True, False, [0.1])
    assert from_run(_sharded_run("replicate", **{**facts, "model_params_stepped": 0})).moves is None
    assert from_run(_sharded_run("replicate", **{**facts, "grads_nonfinite_steps": [2]})).moves is None


def test_a_straggler_is_one_rule_on_medians_or_on_bounds() -> None:
    """DDP's exchange carries the other ranks' medians; a sharded model's their bounds. The rule and the evidence
    are the same; `bounds` changes only what the words say the figures are."""
    slow = {
        "rank": 1, "name": 1, "steps": 7, "own_s": 0.060, "own_q": (0.058, 0.063), "own_comm_s": 0.001,
        "others_s": 0.010, "others_q3_s": 0.012, "lost_s": 0.052, "phase": "forward", "phase_extra_s": 0.049,
    }  # fmt: skip
    for parallelism, bounds in (("ddp", False), ("fsdp2", True), ("replicate", True)):
        (f,) = straggler_rank(Agreed(parallelism=parallelism, world=4, slowest=Slowest(**slow, bounds=bounds)))
        measured = {m.name: m.value for m in f.measured}
        assert (f.code, f.severity, f.ranks, f.labels) == (
            "straggler-rank",
            "warning",
            [1],
            {"clock": "host", "phase": "forward"},
        )
        assert measured == {"own_work_slowest": 0.060, "own_work_others": 0.010, "others_wait": 0.052, "steps_timed": 7}
    # The others do not wait for it (a wait every rank shares), or too few steps: nothing.
    assert straggler_rank(Agreed(parallelism="ddp", world=4, slowest=Slowest(**{**slow, "lost_s": 0.001}))) == []
    assert straggler_rank(Agreed(parallelism="fsdp2", world=4, slowest=Slowest(**{**slow, "steps": 3}))) == []


def test_buffers_apart_are_one_verdict_the_parallelism_words_the_fix_of() -> None:
    """Made apart and never changed: an error everywhere; changed apart in training (running statistics): a
    warning. DDP's fix turns its broadcast on; FSDP2 and `replicate` broadcast no buffer, so theirs copies rank 0's."""
    made = BuffersApart(buffers=[ParamRef("mask", 16, (4, 4))], steps=[0, 1, 2], changing=False, ranks=[0, 1])
    stats = BuffersApart(buffers=[ParamRef("bn.running_mean", 4, (4,))], steps=[2], changing=True, ranks=[0, 1])
    fixes = {}
    for parallelism in ("ddp", "fsdp2", "replicate"):
        flags = {"broadcast_buffers": False} if parallelism == "ddp" else {}
        agreed = Agreed(
            parallelism=parallelism, world=2, ddp_flags=flags, buffers_apart=[made, stats], device_type="cpu"
        )
        error, warning = buffer_divergence(agreed)
        assert (error.code, error.severity, error.param_names, error.steps) == (
            "buffer-divergence",
            "error",
            ["mask"],
            [0, 1, 2],
        )
        assert (warning.severity, warning.param_names, warning.steps) == ("warning", ["bn.running_mean"], [2])
        fixes[parallelism] = error.fix
    assert "broadcast_buffers=True" in fixes["ddp"] and "dist.broadcast(b, src=0)" in fixes["fsdp2"]
    sharded = _sharded_run(
        "replicate",
        buffers=[ParamRef("mask", 16), ParamRef("bn.running_mean", 4)],
        buffers_differ=[True, True],
        buffers_moved=[False, True],
    )
    assert [(b.changing, b.steps, [p.name for p in b.buffers]) for b in from_run(sharded).buffers_apart] == [
        (False, [0, 1, 2], ["mask"]),
        (True, [2], ["bn.running_mean"]),
    ]


def test_samplers_seeded_apart_overlap_alike_whatever_the_parallelism() -> None:
    """Two ranks' DistributedSamplers over 64 samples, seeded 0 and 1: the overlap is computed with torch's own
    sampler, the same for every parallelism."""
    loader = {"sampler": "DistributedSampler", "dataset": 64, "num_replicas": 2, "shuffle": True, "drop_last": False}
    held = {r: {**loader, "rank": r, "seed": r, "epoch": 0, "exact": True, "site": "train.py:20"} for r in (0, 1)}
    found = []
    for parallelism in ("ddp", "fsdp2", "replicate"):
        (f,) = shards_overlap(Agreed(parallelism=parallelism, world=2, samplers_apart=SamplersApart(held, [1])))
        measured = {m.name: m.value for m in f.measured}
        assert (f.code, f.severity, f.ranks, f.sites) == ("shards-overlap", "warning", [0, 1], ["train.py:20"])
        found.append((measured["indices_read_twice"], measured["indices_unread"]))
    assert len(set(found)) == 1 and 0 < found[0][0] < 32 and found[0][0] == found[0][1]  # read twice = unread


def test_replicas_apart_are_put_under_the_cause_another_finding_names_whatever_the_parallelism() -> None:
    """The weights apart name the same parameters, ranks and steps on every road; a cause found (the learning
    rate apart) is their fix on every road; without one, DDP says what it ruled out and a replicated model that
    was apart at its first comparison most likely started apart (replicate broadcasts nothing at the wrap)."""
    head = [ParamRef("head.weight", 8, (2, 4))]
    apart = WeightsApart(
        params=head, reference=0, ranks=[1], at_start=False, steps=[2], first_step=2, observed=8, gap=0.5
    )
    for parallelism in ("ddp", "fsdp2", "replicate"):
        agreed = Agreed(parallelism=parallelism, world=2, weights_apart=apart)
        (f,) = replica_divergence(agreed, frozenset({"optimizer-differs"}))
        assert (f.code, f.severity, f.param_names, f.ranks, f.steps) == (
            "replica-divergence",
            "error",
            ["head.weight"],
            [0, 1],
            [2],
        )
        assert f.fix.startswith("fix the cause: optimizer-differs") and f.ruled_out == []
        assert f.labels == {"apart_since": "step"}, parallelism
    (ddp,) = replica_divergence(Agreed(parallelism="ddp", world=2, weights_apart=apart), frozenset())
    assert "optimizer-differs" in ddp.ruled_out and "grads-changed-after-sync" in ddp.ruled_out
    first = WeightsApart(params=head, reference=0, ranks=[1], at_start=True, steps=[0], observed=8)
    (seeded,) = replica_divergence(Agreed(parallelism="replicate", world=2, weights_apart=first), frozenset())
    assert seeded.steps == [0] and seeded.labels == {"apart_since": "start"} and "manual_seed" in seeded.fix
    assert replica_divergence(Agreed(parallelism="replicate", world=1, weights_apart=first), frozenset()) == []
