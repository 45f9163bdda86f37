"""refreeze() refuses, on every rank and changing nothing: replicas that already differ, bad arguments, ranks that
disagree on the set or do not call it; the DDP model it replaced raises when called, and a guard follows the new
one."""

from __future__ import annotations

import pytest
import torch
from ddpsteps import train_step
from dist import run_ranks
from scenarios import Net, batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import (
    InvalidArgumentError,
    NotDDPModelError,
    NoTrainableParametersError,
    RankMismatchError,
    ReplicaDivergenceError,
    ReportTimeoutError,
    StaleModelError,
    guard,
    refreeze,
)


def _refuses_divergence(rank: int, world: int, what: str) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    train_step(ddp, opt, rank, 0)
    if rank == world - 1:
        with torch.no_grad():
            if what == "weights":
                ddp.module.head_a.bias[0] += 1e-4
            else:
                opt.state[ddp.module.block[0].weight]["exp_avg"][0, 0] += 1e-4
    with pytest.raises(ReplicaDivergenceError) as info:
        refreeze(ddp, opt, freeze="trunk")
    train_step(ddp, opt, rank, 1)  # nothing changed: the old DDP still trains
    return {
        "params": info.value.params,
        "ranks": info.value.ranks,
        "message": str(info.value),
        "trunk_trainable": ddp.module.trunk.weight.requires_grad,
    }


@pytest.mark.parametrize(
    ("world", "what", "name"), [(3, "weights", "head_a.bias"), (2, "optimizer", "block.0.weight (optimizer state)")]
)
def test_refuses_when_the_replicas_already_differ(tmp_path, world, what, name) -> None:
    for res in run_ranks(_refuses_divergence, tmp_path, world_size=world, args=(what,)):
        assert res["params"] == [name] and res["ranks"] == [world - 1] and res["trunk_trainable"]
        assert f"rank(s) [{world - 1}] differ from rank 0" in res["message"]
        assert "Nothing was changed" in res["message"]


def _old_model_is_stale(rank: int, world: int) -> str:
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    new = refreeze(ddp, opt, freeze="head_b")
    x, _ = batch(rank, 0)
    new(x)
    with pytest.raises(StaleModelError) as info:
        ddp(x)
    return str(info.value)


def test_the_replaced_model_raises_when_called(tmp_path) -> None:
    for message in run_ranks(_old_model_is_stale, tmp_path):
        assert "replaced by ddp_doctor.refreeze() at" in message and "test_refreeze_refusals.py" in message


def _guard_follows(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = guard(ddp, every=2, on_problem="raise", optimizer=opt)
    train_step(ddp, opt, rank, 0)
    ddp = refreeze(ddp, opt, freeze="trunk")
    for step in range(1, 5):
        train_step(ddp, opt, rank, step)  # no flip reported: the guard now watches the new DDP
    ddp.module.head_b.weight.requires_grad_(False)
    code = None
    try:
        train_step(ddp, opt, rank, 5)
    except Exception as exc:  # noqa: BLE001
        code = getattr(exc, "code", type(exc).__name__)
    g.close()
    return {"code": code, "checks": g.checks}


def test_a_guard_moves_to_the_rebuilt_model(tmp_path) -> None:
    assert run_ranks(_guard_follows, tmp_path) == [{"code": "frozen-after-wrap", "checks": 2}] * 2


def _bad_arguments(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    net = Net()
    net.head_b.weight.requires_grad_(False)
    net.head_b.bias.requires_grad_(False)
    ddp = DDP(net)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    messages = []
    for kwargs, error in [
        ({"freeze": "trunc"}, InvalidArgumentError),
        ({"freeze": nn.Linear(2, 2)}, InvalidArgumentError),
        ({"freeze": "trunk", "unfreeze": ["trunk.weight"]}, InvalidArgumentError),
        ({"unfreeze": "head_b"}, InvalidArgumentError),
        ({"freeze": lambda n, p: True}, NoTrainableParametersError),
        ({"freeze": 3}, InvalidArgumentError),
    ]:
        with pytest.raises(error) as info:
            refreeze(ddp, opt, **kwargs)
        messages.append(str(info.value))
    with ddp.no_sync(), pytest.raises(InvalidArgumentError) as info:
        refreeze(ddp, opt, freeze="trunk")
    messages.append(str(info.value))
    with pytest.raises(NotDDPModelError) as info:
        refreeze(net, opt)
    messages.append(str(info.value))
    return messages


def test_bad_arguments(tmp_path) -> None:
    for m in run_ranks(_bad_arguments, tmp_path):
        assert "freeze= names 'trunc', which is neither a parameter nor a module" in m[0] and "'trunk'" in m[0]
        assert "not a submodule of the DDP model (Net)" in m[1]
        assert "both in freeze= and unfreeze=: ['trunk.weight']" in m[2]
        assert "would unfreeze ['head_b.weight', 'head_b.bias'], but the optimizer does not update them" in m[3]
        assert "add_param_group" in m[3]
        assert "none of the 8 parameters would require a gradient" in m[4]
        assert "got int" in m[5]
        assert "inside no_sync()" in m[6]
        assert "not the module inside it" in m[7]


def _disagreeing_ranks(rank: int, world: int, case: str) -> str:
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if case == "predicate":
        spec = (lambda n, p: n.startswith("trunk")) if rank == 0 else (lambda n, p: n.startswith("block"))
    else:
        spec = "trunk" if rank != 1 else "no_such_module"
    with pytest.raises((RankMismatchError, InvalidArgumentError)) as info:
        refreeze(ddp, opt, freeze=spec)
    train_step(ddp, opt, rank, 0)  # nothing changed on any rank
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("case", ["predicate", "invalid on one rank"])
def test_ranks_that_disagree_raise_on_every_rank(tmp_path, case) -> None:
    messages = run_ranks(_disagreeing_ranks, tmp_path, world_size=3, args=(case,))
    if case == "predicate":
        assert all(m.startswith("RankMismatchError") and "different trainable set" in m for m in messages)
    else:
        assert messages[1].startswith("InvalidArgumentError") and "no_such_module" in messages[1]
        for m in (messages[0], messages[2]):
            assert m.startswith("RankMismatchError") and "rejected on rank(s) [1]" in m


def _called_on_one_rank(rank: int, world: int) -> str | None:
    torch.manual_seed(0)
    ddp = DDP(Net())
    if rank == 1:
        return None  # rank 1 forgets to call refreeze
    with pytest.raises(ReportTimeoutError) as info:
        refreeze(ddp, freeze="trunk", timeout=2)
    assert ddp.module.trunk.weight.requires_grad
    return str(info.value)


def test_a_rank_that_does_not_call_refreeze_is_named(tmp_path) -> None:
    message = run_ranks(_called_on_one_rank, tmp_path, timeout=40)[0]
    assert "waited 2 s in refreeze() for rank(s) [1]" in message and "every rank of the DDP's process group" in message
