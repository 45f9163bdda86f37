"""The FSDP2 recommendation's decisions, from facts alone (`analyze/sharded.py`; the real runs that produce these
facts are in tests/launch/test_check_fsdp2.py and test_check_replicate.py)."""

from __future__ import annotations

from ddp_doctor.analyze.diagnose import diagnose_sharded
from ddp_doctor.analyze.sharded import sharded_recommendation, verified_reshard
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

CANDIDATE = {"module": "layers.2", "call": 2, "site": "train.py:68"}


def _run(**facts) -> ShardedRun:
    sharding = {"api": "fully_shard", "root_sharded": True, "all_gathers_per_step": 7}
    sharding.update(facts.pop("sharding", {}))
    defaults = {"model_params_stepped": 10, "reshard_candidate": CANDIDATE}
    return ShardedRun(
        world=2, steps=8, optimizer="AdamW", optimizer_site=None, sharding=sharding, model_params=10,
        **{**defaults, **facts},
    )  # fmt: skip


def test_the_reshard_advice_names_the_module_and_line_and_waits_for_its_second_run() -> None:
    rec = sharded_recommendation(_run())
    assert rec.reshard == {**CANDIDATE, "all_gathers_per_step": 7, "reshard_after_forward": False}
    assert not rec.verified and not rec.flags_known
    assert rec.reason.startswith(
        "For speed: `reshard_after_forward=False` on layers.2 (the fully_shard call at train.py:68)"
    )
    assert "Not yet verified" in rec.reason


def test_a_second_run_with_fewer_all_gathers_and_the_same_findings_verifies_it() -> None:
    rec = verified_reshard(sharded_recommendation(_run()), 6, True, None)
    assert rec.verified and rec.reshard["verified_all_gathers_per_step"] == 6
    assert "Verified: a second run of the script with it applied made 6 all-gathers per step instead of 7" in rec.reason
    assert "Not yet verified" not in rec.reason


def test_a_second_run_that_shows_no_gain_or_other_findings_or_fails_does_not_verify_it() -> None:
    first = sharded_recommendation(_run())
    same = verified_reshard(first, 7, True, None)
    assert not same.verified and "counted 7 all-gathers per step (the first counted 7)" in same.reason
    other = verified_reshard(first, 6, False, None)
    assert not other.verified and "found other problems than the first" in other.reason
    failed = verified_reshard(first, None, False, "rank 1 crashed")
    assert not failed.verified and "failed: rank 1 crashed" in failed.reason


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
