"""progressive_freeze(): each entry of the schedule applied by refreeze() at its step (the bytes DDP sends shrink
then, counted through a comm hook), a resumed schedule applying what it passed in one rebuild, and its names checked
up front."""

from __future__ import annotations

import pytest
import torch
from ddpsteps import counting_hook, nbytes, train_step
from dist import run_ranks
from scenarios import Net
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import InvalidArgumentError, progressive_freeze


def _progressive_twice(rank: int, world: int) -> list[dict]:
    return [_progressive(rank, world, None), _progressive(rank, world, 4)]


def _progressive(rank: int, world: int, resume_at: int | None) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net())
    sent: list[int] = []
    ddp.register_comm_hook(sent, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    schedule = progressive_freeze(ddp, opt, freeze={1: "trunk", 3: ["block.0"]})
    per_step, rebuilt = [], []
    for step in range(resume_at or 0, 5):
        model = schedule.update(step)
        rebuilt.append(model is not ddp)
        ddp = model
        sent.clear()
        train_step(ddp, opt, rank, step)
        per_step.append(sum(sent))
    return {"bytes": per_step, "rebuilt": rebuilt, "applied": schedule.applied, "pending": schedule.pending}


def test_progressive_freeze_by_step(tmp_path) -> None:
    net = Net()
    full = nbytes(net)
    no_trunk = full - nbytes(net, ["trunk.weight", "trunk.bias"])
    no_block = no_trunk - nbytes(net, ["block.0.weight", "block.0.bias"])
    res, resumed = run_ranks(_progressive_twice, tmp_path)[0]
    assert res["bytes"] == [full, no_trunk, no_trunk, no_block, no_block]
    assert res["rebuilt"] == [False, True, False, True, False]
    assert res["applied"] == [1, 3] and res["pending"] == []
    # Resuming at step 4 applies both entries in one rebuild.
    assert resumed["bytes"] == [no_block] and resumed["rebuilt"] == [True] and resumed["applied"] == [1, 3]


def test_progressive_freeze_checks_names_up_front(tmp_path) -> None:
    message = run_ranks(_bad_schedule, tmp_path, world_size=1)[0]
    assert "'blocks.0'" in message and "Did you mean 'block.0'" in message


def _bad_schedule(rank: int, world: int) -> str:
    ddp = DDP(Net())
    with pytest.raises(InvalidArgumentError) as info:
        progressive_freeze(ddp, freeze={2: ["blocks.0"]})
    with pytest.raises(InvalidArgumentError, match="non-negative ints"):
        progressive_freeze(ddp, freeze={-1: ["block.0"]})
    return str(info.value)
