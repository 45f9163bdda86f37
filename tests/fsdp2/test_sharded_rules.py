"""The FSDP2 recommendation's decisions, from facts alone (`analyze/sharded.py`; the real runs that produce these
facts are in tests/fsdp2/test_check_fsdp2.py and test_check_replicate.py)."""

from __future__ import annotations

import dataclasses

from ddp_doctor.analyze.diagnose import diagnose_sharded
from ddp_doctor.analyze.sharded import sharded_recommendation, verified_reshard
from ddp_doctor.core.agreed import HeldApart
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of
from ddp_doctor.report.data import recommendation_words

CANDIDATE = {"module": "layers.2", "call": 2, "site": "train.py:68"}


def _run(**facts) -> ShardedRun:
    sharding = {"api": "fully_shard", "root_sharded": True, "all_gathers_per_step": 7}
    sharding.update(facts.pop("sharding", {}))
    defaults = {"model_params_stepped": 10, "reshard_candidate": CANDIDATE}
    defaults = {"steps": 8, **defaults}
    return ShardedRun(
        world=2, optimizer="AdamW", optimizer_site=None, sharding=sharding, model_params=10, **{**defaults, **facts}
    )


def test_the_reshard_advice_names_the_module_and_line_and_waits_for_its_second_run() -> None:
    rec = sharded_recommendation(_run())
    assert rec.reshard == {**CANDIDATE, "all_gathers_per_step": 7, "reshard_after_forward": False}
    assert not rec.verified and not rec.flags_known
    assert "verification" not in rec.reshard and "withdrawn" not in rec.reshard


def test_a_second_run_with_fewer_all_gathers_and_the_same_findings_verifies_it() -> None:
    first = sharded_recommendation(_run())
    rec = verified_reshard(first, 6, True, None)
    assert rec.verified and rec.reshard["verified_all_gathers_per_step"] == 6
    assert rec.reshard["verification"] == {"all_gathers_per_step": 6, "same_findings": True, "error": None}
    assert rec.reason == first.reason  # the analysis' words are not edited; the report words the verdict


def test_a_second_run_that_shows_no_gain_or_other_findings_or_fails_does_not_verify_it() -> None:
    first = sharded_recommendation(_run())
    same = verified_reshard(first, 7, True, None)
    assert not same.verified and same.reshard["verification"]["all_gathers_per_step"] == 7
    other = verified_reshard(first, 6, False, None)
    assert not other.verified and other.reshard["verification"]["same_findings"] is False
    failed = verified_reshard(first, None, False, "rank 1 crashed")
    assert not failed.verified and failed.reshard["verification"]["error"] == "rank 1 crashed"
    assert all("verified_all_gathers_per_step" not in r.reshard for r in (same, other, failed))
    assert all(r.reshard["withdrawn"] for r in (same, other, failed))  # advice its second run did not prove


def test_no_advice_while_the_run_has_errors_on_one_rank_or_when_uncounted() -> None:
    optimizer_replaced = diagnose_sharded(_run(replaced=10, model_params_stepped=0))
    assert optimizer_replaced.findings[0].severity == "error"
    assert optimizer_replaced.recommendation.reshard is None
    assert "looked at once the errors above are fixed" in optimizer_replaced.recommendation.reason
    one_rank = sharded_recommendation(_run(sharding={"all_gathers_per_step": 0}))
    assert one_rank.reshard is None and "one rank holds every shard" in one_rank.reason
    uncounted = sharded_recommendation(_run(sharding={"all_gathers_per_step": None}))
    assert uncounted.reshard is None and "could not be counted" in uncounted.reason


def test_replicate_gets_no_reshard_advice_and_its_own_parallelism() -> None:
    run = _run(sharding={"api": "replicate"})
    assert parallelism_of(run.sharding) == "replicate" and parallelism_of(None) == "ddp"
    rec = sharded_recommendation(run)
    assert rec.reshard is None and "replicates its model with FSDP2's replicate" in rec.reason


def test_parameters_outside_every_group_are_an_error_an_info_or_a_warning_as_measured() -> None:
    """analyze/unsharded.py: differ -> error; trained and equal -> info (something syncs them); unchanged and
    equal -> warning. The cause and the fix follow why they are outside: ignored_params, or the root unsharded."""
    from ddp_doctor.core.findings import ParamRef

    head = [ParamRef("head.weight", 256, (4, 64)), ParamRef("head.bias", 4, (4,))]

    def finding(**facts):
        (f,) = [f for f in diagnose_sharded(_run(unsharded=head, **facts)).findings]
        return f

    ignored = {"ignored": [True, True], "ignored_site": "train.py:42"}
    error = finding(unsharded_differ=[True, False], unsharded_gap=0.166, **ignored)
    assert error.severity == "error" and [p.name for p in error.params] == ["head.weight"]
    assert (error.labels, error.sites) == ({"kind": "ignored"}, ["train.py:42"])
    assert {m.name: m.value for m in error.measured} == {"largest_sum_gap": 0.166, "steps_observed": 8}
    info = finding(unsharded_differ=[False, False], unsharded_changed=True, **ignored)
    assert (info.severity, info.labels, info.sites) == ("info", {"kind": "ignored"}, ["train.py:42"])
    assert [p.name for p in info.params] == ["head.weight", "head.bias"]
    warning = finding(unsharded_differ=[False, False], sharding={"root_sharded": False})
    assert (warning.severity, warning.labels, warning.sites) == ("warning", {"kind": "root"}, [])
    added = finding(unsharded_differ=[False, True])
    assert (added.severity, added.labels, [p.name for p in added.params]) == ("error", {"kind": "added"}, ["head.bias"])
    one_step = finding(unsharded_differ=[False, False], unsharded_changed=True, steps=1)
    assert one_step.severity == "warning", "one step shows no training: nothing is known to sync them"


def test_the_fixes_are_in_the_words_of_the_framework_that_runs_the_job() -> None:
    """Accelerate's plugin note and Accelerate's save route only where Accelerate (or the Trainer) may have built
    the sharding; Lightning's `ModelParallelStrategy` gets its own words, then plain torch's."""
    facts = {"replaced": 10, "model_params_stepped": 0, "shard_save": {"shown": "ck.pt"}, "shard_save_ranks": 1}
    for framework in ("torch", "accelerate", "lightning"):
        found = {f.code: f.fix for f in diagnose_sharded(_run(framework=framework, **facts)).findings}
        lightning = framework == "lightning"
        assert ("`trainer.save_checkpoint(path)` on every rank" in found["sharded-checkpoint-incomplete"]) == lightning
        assert ("accelerator.save_state" in found["sharded-checkpoint-incomplete"]) != lightning
        assert ("`configure_optimizers`" in found["optimizer-params-replaced"]) == lightning
        assert "`optimizer = torch.optim.AdamW(model.parameters(), ...)`" in found["optimizer-params-replaced"]
        advice = recommendation_words(sharded_recommendation(_run(framework=framework)), framework)
        assert ("Accelerate's FSDP2 plugin" in advice) == (framework == "accelerate"), framework


def test_shards_scaled_by_factors_of_their_own_are_grads_changed_after_sync_with_the_steps_and_spread() -> None:
    scaled = _run(scale_steps=[1, 2, 3], scale_differ_steps=[2, 3], scale_spread=1.25)
    (f,) = [f for f in diagnose_sharded(scaled).findings if f.code == "grads-changed-after-sync"]
    assert (f.severity, f.ranks, f.steps) == ("error", [0, 1], [2, 3])
    assert {m.name: m.value for m in f.measured} == {"largest_scale_ratio": 1.25, "steps_measured": 3}
    alike = diagnose_sharded(_run(scale_steps=[1, 2, 3]))
    assert "grads-changed-after-sync" not in {f.code for f in alike.findings}
    assert alike.compared["gradient_scale_steps"] == 3


def test_optimizer_settings_and_modes_apart_are_named_at_their_first_step_with_the_ranks() -> None:
    settings = HeldApart(
        step=3,
        reference=0,
        held={
            0: "group 0 (6 tensors) lr=0.005, weight_decay=0.01",
            2: "group 0 (6 tensors) lr=0.01, weight_decay=0.01",
        },
        ranks=[2, 3],
        more=1,
    )
    modes = HeldApart(
        step=5,
        reference=1,
        held={
            1: {"training": True, "other_mode": [], "other_mode_count": 0},
            0: {"training": False, "other_mode": [], "other_mode_count": 0},
        },
        ranks=[0],
    )
    for api in ("fully_shard", "replicate"):
        run = _run(settings_apart=settings, modes_apart=modes, state_steps=8, modules=9, sharding={"api": api})
        found = {f.code: f for f in diagnose_sharded(run).findings}
        differs, parted = found["optimizer-differs"], found["replica-divergence"]
        assert (differs.severity, differs.ranks, differs.steps, differs.more_ranks) == ("error", [0, 2, 3], [3], 1)
        assert differs.title.startswith("the optimizer's lr differs"), differs.title  # the one field that differs
        assert (parted.severity, parted.ranks, parted.steps, parted.more_ranks) == ("warning", [0, 1], [5], 0)
        compared = diagnose_sharded(run).compared
        assert (compared["state_steps"], compared["modules"]) == (8, 9)
    alike = diagnose_sharded(_run(state_steps=8, modules=9))
    assert not {"optimizer-differs", "replica-divergence"} & {f.code for f in alike.findings}


def test_parameters_that_never_change_while_the_rest_train_are_a_warning_only_then() -> None:
    from ddp_doctor.core.findings import ParamRef

    body = ParamRef("body.weight", 4096, (64, 64))
    head = [ParamRef("head.weight", 256, (4, 64)), ParamRef("head.bias", 4, (4,))]
    # per parameter over the ranks: (a gradient, one other than 0, the weights moved); the optimizer holds the body
    moving = {
        "grads_measured_steps": list(range(1, 8)),
        "model_changed": True,
        "params": [body, *head],
        "params_trainable": [True, True, True],
        "params_grads": [(True, True, True), (True, True, False), (True, True, False)],
        "params_held": [True, False, False],
        "params_zero_lr": [False, False, False],
    }
    (f,) = [f for f in diagnose_sharded(_run(**moving)).findings if f.code == "training-stalled"]
    assert (f.severity, [p.name for p in f.params], f.steps) == (
        "warning",
        ["head.weight", "head.bias"],
        list(range(1, 8)),
    )
    assert {m.name: m.value for m in f.measured}["held_by_the_optimizer"] == 0
    # nothing moved at all: the whole job is stalled (an error), not these parameters
    (g,) = [g for g in diagnose_sharded(_run(**{**moving, "model_changed": False})).findings]
    assert (g.code, g.severity, g.params) == ("training-stalled", "error", [])
    # weights in the low dtype the policy computes in: low-precision-weights explains them, said once
    low = _run(weights_dtype=["bfloat16"], sharding={"param_dtype": ["bfloat16"]}, **moving)
    (w,) = diagnose_sharded(low).findings
    assert (w.code, w.labels) == ("low-precision-weights", {"weights_dtype": "bfloat16", "param_dtype": "bfloat16"})


def test_unused_parameters_and_buffers_apart_are_decided_from_the_agreed_per_tensor_facts() -> None:
    """A trainable parameter no rank got a gradient for is unused (a frozen one is not); a buffer apart that never
    changed was made apart (an error), one that changed in training is running statistics (a warning)."""
    from ddp_doctor.core.findings import ParamRef

    params = [
        ParamRef("body.weight", 64, (8, 8)),
        ParamRef("aux.weight", 8, (1, 8)),
        ParamRef("frozen.weight", 8, (1, 8)),
    ]
    buffers = [ParamRef("mask", 16, (4, 4)), ParamRef("bn.running_mean", 8, (8,)), ParamRef("scale", 1, ())]
    run = _run(
        params=params,
        params_trainable=[True, True, False],
        params_grads=[(True, True, True), (False, False, False), (False, False, False)],
        params_held=[True, True, False],
        params_zero_lr=[False, False, False],
        buffers=buffers,
        buffers_differ=[True, True, False],
        buffers_moved=[False, True, False],
    )
    found = {(f.code, f.severity): f for f in diagnose_sharded(run).findings}
    assert [p.name for p in found["unused-parameters", "warning"].params] == ["aux.weight"]
    assert [p.name for p in found["buffer-divergence", "error"].params] == ["mask"]
    assert [p.name for p in found["buffer-divergence", "warning"].params] == ["bn.running_mean"]
    # not every rank saw a step with gradient sync on: no parameter is called unused
    blind = dataclasses.replace(run, params_grads=None)
    assert "unused-parameters" not in {f.code for f in diagnose_sharded(blind).findings}
