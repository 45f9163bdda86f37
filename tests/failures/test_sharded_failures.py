"""The FSDP2 failure findings from rank states alone (`analyze/sharded_failures.py`; the real runs are in
tests/fsdp2/test_check_fsdp2.py)."""

from __future__ import annotations

from ddp_doctor.analyze.epochs import ran_out_alone
from ddp_doctor.analyze.sharded_failures import gather_alone, step_skipped_alone
from ddp_doctor.core.rankstate import RankState

GATHER = "get_model_state_dict at tests/scripts/fsdp2_train.py:62"
STALE = "tests/scripts/fsdp2_train.py:102  F.cross_entropy(model(x), y).backward()"


def _state(rank: int, gathers: dict[str, int], *, innermost: str = "train.py:99 in backward") -> RankState:
    # Every rank had published its sharding at its first step (the counts start there).
    return RankState(
        rank=rank,
        world_size=2,
        step=3,
        phase="between steps",
        user_frame=STALE,
        innermost=innermost,
        gathers=gathers,
        sharding={"api": "fully_shard"},
    )


def test_a_gather_counted_on_rank_0_alone_is_named_whatever_its_stale_sample_says() -> None:
    """CI, 2026-11-26, a loaded 2-core machine: rank 0's last sample (1.3 s old) showed it in the backward before the
    gather, and the report had `rank-crashed` alone. The count, published before the gather's collective, names it."""
    found = gather_alone({0: _state(0, {GATHER: 6}), 1: _state(1, {})}, ["enforce fail at pair.cc:456"])
    assert found is not None and found.code == "state-gather-some-ranks"
    assert (found.sites, found.labels) == (
        ["tests/scripts/fsdp2_train.py:62"],
        {
            "call": "get_model_state_dict",
            "site": "tests/scripts/fsdp2_train.py:62",
            "ranks_alone": "0",
            "native": "enforce fail at pair.cc:456",  # the communication library's own words reach the user
        },
    )


def test_a_gather_every_rank_counted_is_no_finding_even_with_other_counts() -> None:
    assert gather_alone({0: _state(0, {GATHER: 6}), 1: _state(1, {GATHER: 5})}, []) is None
    assert gather_alone({0: _state(0, {}), 1: _state(1, {})}, []) is None


def test_without_counts_the_sample_or_traceback_still_names_a_gather() -> None:
    """A gather before the first optimizer step is not counted: the rank's innermost frame is the evidence."""
    inside = "torch/distributed/checkpoint/state_dict.py:1210 in get_model_state_dict"
    found = gather_alone({0: _state(0, {}, innermost=inside), 1: _state(1, {})}, [])
    assert found is not None and found.labels["call"] == "get_model_state_dict", found
    assert found.labels["ranks_alone"] == "0" and "native" not in found.labels, found


def _loader_state(rank: int, batches: int, step: int) -> RankState:
    state = _state(rank, {})
    state.step = step
    state.train_loader = {"site": "train.py:30", "batches": batches}
    return state


def test_a_rank_that_ran_out_of_batches_is_the_cause_not_what_it_did_next() -> None:
    found = ran_out_alone({0: _loader_state(0, 20, 12), 1: _loader_state(1, 12, 12)})
    assert found is not None and found.code == "uneven-inputs" and found.severity == "error"
    assert found.sites == ["train.py:30"], found
    measured = {m.name: m.value for m in found.measured}
    assert measured == {"batches_most": 20, "batches_fewest": 12, "batches (rank 0)": 20, "batches (rank 1)": 12}
    assert "Join does not cover a sharded model" in found.fix


def test_different_lengths_are_no_cause_of_a_failure_before_any_rank_ran_out() -> None:
    assert ran_out_alone({0: _loader_state(0, 20, 3), 1: _loader_state(1, 12, 3)}) is None
    assert ran_out_alone({0: _loader_state(0, 12, 12), 1: _loader_state(1, 12, 12)}) is None


def _steps_state(rank: int, step: int, forwards: int, *, api: str = "fully_shard", raised: str | None = None):
    from ddp_doctor.core.rankfiles import RaisedError

    state = _state(rank, {})
    state.step, state.forwards, state.sharding = step, {"train.py:50": forwards}, {"api": api}
    if raised is not None:
        state.raised = RaisedError(type="RuntimeError", message=raised, peer_lost=raised == "Connection closed by peer")
    return state


def test_a_rank_with_fewer_steps_over_more_forwards_skipped_a_step() -> None:
    """tests/sync/test_check_fsdp2_state.py and test_check_replicate.py have the real runs: rank 0 at its 8th step
    after 14 forwards, rank 1 at its 7th inside its 15th forward (or the backward after it), which then lost its peer."""
    for api in ("fully_shard", "replicate"):
        states = {
            0: _steps_state(0, 8, 14, api=api),
            1: _steps_state(1, 7, 15, api=api, raised="Connection closed by peer"),
        }
        found = step_skipped_alone(states)
        assert found is not None and found.code == "optimizer-step-skipped" and found.ranks == [0, 1], api
        measured = {m.name: m.value for m in found.measured}
        assert measured == {
            "optimizer_steps_rank_0": 8,
            "forwards_rank_0": 14,
            "optimizer_steps_rank_1": 7,
            "forwards_rank_1": 15,
        }


def test_a_rank_behind_in_steps_and_forwards_or_crashed_of_its_own_is_no_skip() -> None:
    # Behind in both counts: slower, or stopped elsewhere; not a skip.
    assert step_skipped_alone({0: _steps_state(0, 8, 14), 1: _steps_state(1, 7, 13)}) is None
    # As many steps: nothing skipped, whatever the forwards (an evaluation on rank 1).
    assert step_skipped_alone({0: _steps_state(0, 8, 14), 1: _steps_state(1, 8, 15)}) is None
    # A rank that raised an error of its own: that error is the cause.
    crashed = {0: _steps_state(0, 8, 14), 1: _steps_state(1, 7, 15, raised="ValueError: bad batch")}
    assert step_skipped_alone(crashed) is None
    # One rank: nothing to compare.
    assert step_skipped_alone({0: _steps_state(0, 8, 14)}) is None
