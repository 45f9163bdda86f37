"""gather: the only communication. Mismatched ranks raise everywhere instead of hanging."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

from ddp_doctor import RankMismatchError
from ddp_doctor.gather import gather
from ddp_doctor.records import ModelInfo, RankRecord, StepCounters


def _info(names: list[str]) -> ModelInfo:
    return ModelInfo(param_names=names, param_shapes=[(2,)] * len(names), trainable_at_wrap=[True] * len(names),
                     ignored=[False] * len(names), buffer_names=[], buffer_shapes=[], ddp_config={})


def _mismatch(rank: int, world: int) -> str:
    names = ["a", "b"] if rank == 0 else ["a", "b", "c"]
    with pytest.raises(RankMismatchError) as info:
        gather(RankRecord.empty(rank, len(names), 0), _info(names), timeout=10, tag="t", device=torch.device("cpu"))
    return str(info.value)


def test_different_parameter_lists_raise_on_every_rank(tmp_path) -> None:
    messages = run_ranks(_mismatch, tmp_path)
    assert all("rank 0: 2 params" in m and "rank 1: 3 params" in m for m in messages)


def _uneven_steps(rank: int, world: int) -> list[int]:
    """Ranks with different step counts still exchange fixed shapes and get each other's records back intact."""
    record = RankRecord.empty(rank, 2, 1)
    steps = 1 + rank
    record.used = torch.ones(steps, 2, dtype=torch.bool)
    for name in ("reachable", "trainable"):
        setattr(record, name, torch.ones(steps, 2, dtype=torch.bool))
    record.grad_fp = torch.full((steps, 2, 2), float(rank))
    record.weight_fp = torch.zeros(steps + 1, 2, 2, dtype=torch.float64)
    record.buffer_fp = torch.zeros(steps, 1, 2, dtype=torch.float64)
    record.input_fp = torch.zeros(steps, 2, dtype=torch.float64)
    record.timing = torch.zeros(steps, 3, dtype=torch.float64)
    record.counters = torch.zeros(steps, len(StepCounters.FIELDS), dtype=torch.int64)
    record.bypass_sites = [f"rank{rank}.py:1"]
    _, records = gather(record, _info(["a", "b"]), timeout=10, tag="u", device=torch.device("cpu"))
    return [r.steps for r in records] + [float(r.grad_fp[0, 0, 0]) for r in records] + [r.bypass_sites for r in records]


def test_uneven_step_counts_round_trip(tmp_path) -> None:
    a, b = run_ranks(_uneven_steps, tmp_path)
    assert a == b == [1, 2, 0.0, 1.0, ["rank0.py:1"], ["rank1.py:1"]]
