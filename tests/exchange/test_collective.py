"""_collective: the cross-rank agreement every collective entry point starts with, and the named arrival check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks

from ddp_doctor import RankMismatchError, ReportTimeoutError
from ddp_doctor.exchange.primitives import agree, arrive, comm_device, layout_hash, minmax

_CPU = torch.device("cpu")


def _agree(rank: int, world: int, odd_rank: int | None) -> dict:
    layout = layout_hash(["a:(2,)", "b:(3,)"] if rank != odd_rank else ["a:(2,)", "c:(3,)"])
    try:
        headers = agree(
            [layout, 2],
            group=None,
            device=_CPU,
            what="test found different models",
            cause="names",
            describe=lambda h: f"{int(h[1])} tensors",
            fix="Build the same model.",
        )
    except RankMismatchError as exc:
        return {"raised": str(exc)}
    return {"raised": None, "rows": None if headers is None else headers.rows}


def test_ranks_that_agree_pass(tmp_path) -> None:
    for res in run_ranks(_agree, tmp_path, world_size=4, args=(None,)):
        assert res == {"raised": None, "rows": None}  # no second collective, nothing to return


def test_one_rank_of_four_differs_every_rank_raises_naming_it(tmp_path) -> None:
    for res in run_ranks(_agree, tmp_path, world_size=4, args=(2,)):
        message = res["raised"]
        assert message is not None and message.startswith("test found different models (rank 0: 2 tensors, ")
        assert "rank(s) [2] differ from rank 0 in names). Build the same model." in message


def _failure(rank: int, world: int, failing: dict[int, int]) -> dict:
    headers = agree(
        [7], failed=failing.get(rank, 0), group=None, device=_CPU, what="w", cause="c", describe=str, fix="f"
    )
    return {
        "failed": headers.failed,
        "more": headers.more_failed,
        "ranks": headers.ranks,
        "codes": headers.codes,
        "rows": headers.rows,
    }


def test_a_local_failure_is_returned_to_every_rank_instead_of_raising(tmp_path) -> None:
    # The headers returned are the failed ranks' (named in bounded space), not every rank's.
    expected = {"failed": [1], "more": 0, "ranks": [1], "codes": [4], "rows": [[7.0]]}
    assert run_ranks(_failure, tmp_path, world_size=3, args=({1: 4},)) == [expected] * 3


def _without_gathering(rank: int, world: int, case: str) -> dict:
    """agree() with all_gather made to raise: its failure and mismatch paths only all_reduce."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("agree() must not all_gather")

    dist.all_gather = refuse
    if case == "failure":
        return _failure(rank, world, {2: 1, 5: 2, 7: 1})
    return _agree(rank, world, rank if rank in (2, 5, 7) else None)


def test_failed_ranks_are_named_without_gathering(tmp_path) -> None:
    failure = run_ranks(_without_gathering, tmp_path, world_size=8, args=("failure",), timeout=120)
    assert (
        failure == [{"failed": [2, 5, 7], "more": 0, "ranks": [2, 5, 7], "codes": [1, 2, 1], "rows": [[7.0]] * 3}] * 8
    )


def test_beyond_nine_ranks_the_message_shows_the_reference_and_the_odd_ranks(tmp_path) -> None:
    for res in run_ranks(_without_gathering, tmp_path, world_size=10, args=("mismatch",), timeout=120):
        assert res["raised"] == (
            "test found different models (rank 0: 2 tensors, rank 2: 2 tensors, rank 5: 2 tensors, rank 7: 2 tensors; "
            "rank(s) [2, 5, 7] differ from rank 0 in names). Build the same model."
        )


def _subgroup(rank: int, world: int) -> str | None:
    """Ranks {1, 3} form a group; rank 3 differs. The message names global ranks, and ranks 0 and 2 take no part."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    try:
        agree(
            [1 if rank != 3 else 2],
            group=group,
            device=comm_device(group),
            what="w",
            cause="c",
            describe=lambda h: f"{int(h[0])}",
            fix="f",
        )
    except RankMismatchError as exc:
        return str(exc)
    return None


def test_ranks_are_named_by_global_rank_within_a_subgroup(tmp_path) -> None:
    results = run_ranks(_subgroup, tmp_path, world_size=4)
    assert results[0] is None and results[2] is None
    for message in (results[1], results[3]):
        assert "(rank 1: 1, rank 3: 2; rank(s) [3] differ from rank 1 in c)" in message


def _minmax_rows(rank: int, world: int) -> tuple[list, list]:
    values = torch.tensor([float(rank), -2.0 * rank])
    hi, lo = minmax(values, None, _CPU)
    return hi.tolist(), lo.tolist()


def test_minmax(tmp_path) -> None:
    expected = ([2.0, 0.0], [0.0, -4.0])
    assert run_ranks(_minmax_rows, tmp_path, world_size=3) == [expected] * 3


def _arrive_alone(rank: int, world: int) -> str | None:
    if rank == 1:
        return None
    with pytest.raises(ReportTimeoutError) as info:
        arrive("alone", group=None, timeout=1, call="thing()", fix="call it everywhere.")
    return str(info.value)


def test_arrive_names_the_rank_that_never_came(tmp_path) -> None:
    message = run_ranks(_arrive_alone, tmp_path, timeout=40)[0]
    assert (
        "rank 0 waited 1 s in thing() for rank(s) [1] of world size 2. thing() is collective: call it "
        "everywhere." in message
    )


def test_layout_hash_is_stable_and_order_sensitive() -> None:
    assert layout_hash(["a", "b"]) == layout_hash(["a", "b"]) != layout_hash(["b", "a"])
    assert 0 <= layout_hash(["x" * 1000]) < 2**31


def _seen_by_the_listeners(rank: int, world: int) -> list[str]:
    from ddp_doctor.observation import collectives

    seen: list[str] = []
    stop = collectives.listen(lambda call: seen.append(call.op))
    try:
        minmax(torch.tensor([1.0]), None, torch.device("cpu"))  # the doctor's own (the exchange's primitives)
        dist.all_reduce(torch.ones(1))  # the script's
    finally:
        stop()
    return seen


def test_only_the_scripts_collectives_reach_the_listeners(tmp_path) -> None:
    # The doctor's exchange once reached them too, and a hung rank's beacon named it as the script's collective.
    assert run_ranks(_seen_by_the_listeners, tmp_path) == [["all_reduce"]] * 2


def _fsdp2_calls_seen(rank: int, world: int) -> tuple[list[str], list[tuple[str, bool]]]:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ddp_doctor.observation import collectives

    script: list[str] = []
    every: list[tuple[str, bool]] = []
    stops = [
        collectives.listen(lambda call: script.append(call.op)),
        collectives.listen(lambda call: every.append((call.op, call.fsdp)), fsdp=True),
    ]
    try:
        model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
        model(torch.ones(2, 4)).sum().backward()
        dist.all_reduce(torch.ones(1))
    finally:
        for stop in stops:
            stop()
    return script, every


def test_fsdp2s_own_collectives_reach_only_the_listeners_that_ask_for_them(tmp_path) -> None:
    """FSDP2's all-gather (forward) and reduce-scatter (backward) of one step on a root-only sharded model, then the
    script's all_reduce: the per-step digest sees all three in order; the beacon's and the epoch end's listeners see
    the script's alone."""
    for script, every in run_ranks(_fsdp2_calls_seen, tmp_path):
        assert script == ["all_reduce"]
        ops = [op for op, _ in every]
        assert ops[-1] == "all_reduce" and not every[-1][1], every
        assert {"all_gather_single", "reduce_scatter_single"} <= set(ops[:-1]), every
        assert all(fsdp for _, fsdp in every[:-1]), every
