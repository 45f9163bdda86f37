"""Records built by hand for the pure analysis's tests (no process group): a four-parameter model's `ModelInfo`,
a rank's `RankRecord` from which parameters got a gradient at each step, and a fixture that fails any collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_doctor.core.records import CRASH_KINDS, TIMING_COLUMNS, ModelInfo, RankRecord, StepCounters

NAMES = ["trunk.weight", "trunk.bias", "head_a.weight", "head_b.weight"]
SHAPES = [(4, 3), (4,), (2, 4), (2, 4)]


def info(**overrides) -> ModelInfo:
    base = {
        "param_names": NAMES,
        "param_shapes": SHAPES,
        "trainable_at_wrap": [True] * 4,
        "ignored": [False] * 4,
        "buffer_names": ["norm.running_mean"],
        "buffer_shapes": [(4,)],
        "ddp_config": {
            "find_unused_parameters": False,
            "static_graph": False,
            "gradient_as_bucket_view": False,
            "broadcast_buffers": True,
        },
    }
    base.update(overrides)
    return ModelInfo(**base)


def record(
    rank: int,
    used: list[list[int]],
    *,
    grad=None,
    weights=None,
    inputs=None,
    trainable=None,
    buffers=None,
    counters=None,
    crash: str = "none",
    crash_step: int = -1,
    ran=None,
    blocked_checkpoints=(),
) -> RankRecord:
    """A rank's record: `used[s][p]` is 1 when param p got a gradient in step s; `ran` (default: `used`) when its
    module ran in forward."""
    steps, n = len(used), len(used[0])
    used_t = torch.tensor(used, dtype=torch.bool)
    default_grad = torch.arange(steps * n * 2, dtype=torch.float64).reshape(steps, n, 2)
    c = StepCounters(ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1)
    return RankRecord(
        rank=rank,
        used=used_t,
        reachable=used_t.clone(),
        ran=torch.tensor(ran, dtype=torch.bool) if ran is not None else used_t.clone(),
        trainable=torch.tensor(trainable, dtype=torch.bool)
        if trainable is not None
        else torch.ones(steps, n, dtype=torch.bool),
        grad_fp=grad if grad is not None else default_grad,
        weight_fp=weights if weights is not None else torch.zeros(steps + 1, n, 2, dtype=torch.float64),
        buffer_fp=buffers if buffers is not None else torch.zeros(steps, 1, 2, dtype=torch.float64),
        input_fp=inputs if inputs is not None else torch.full((steps, 2), float(rank + 1), dtype=torch.float64),
        timing=torch.full((steps, TIMING_COLUMNS), 0.01, dtype=torch.float64),
        counters=counters if counters is not None else torch.tensor([c.as_list()] * steps),
        crash_kind=CRASH_KINDS.index(crash),
        crash_step=crash_step,
        blocked_checkpoints=list(blocked_checkpoints),
    )


@pytest.fixture(autouse=True)
def no_distributed(monkeypatch) -> None:
    """Any collective inside analyze would be a bug: make them all explode."""
    for name in ("all_gather", "all_reduce", "broadcast", "barrier", "get_rank", "get_world_size"):
        monkeypatch.setattr(dist, name, lambda *a, **k: pytest.fail("analyze called torch.distributed"))
    assert not dist.is_initialized()


ALL = [[1, 1, 1, 1]] * 3
