"""refreeze() and progressive_freeze(): optimizer state kept bit-identical, frozen params no longer communicated
(bytes counted through a DDP comm hook), the next steps equal to a run frozen from the start, and a refusal when
the replicas already differ."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
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
    progressive_freeze,
    refreeze,
)
from ddp_doctor.core.compat import HAS_FORWARD_SYNC_BUFFERS
from ddp_doctor.observation.wrapstate import constructor_kwargs

FROZEN = ["trunk.weight", "trunk.bias", "block.0.weight", "block.0.bias"]


def counting_hook(state, bucket):  # no annotations: DDP checks the annotation objects, which strings are not
    """All-reduce like DDP's default, and record the bytes of every bucket."""
    buf = bucket.buffer()
    state.append(buf.numel() * buf.element_size())
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _step(ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    F.mse_loss(ddp(x, use_b=True), y).backward()
    opt.step()
    opt.zero_grad()


def _nbytes(module: nn.Module, names: list[str] | None = None) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if (names is None or n in names))


# ------------------------------------------------------------------------------------------ DDP, measured


def _freeze_without_refreeze(rank: int, world: int, flags: dict) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net(), **flags)
    sent: list[int] = []
    ddp.register_comm_hook(sent, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _step(ddp, opt, rank, 0)
    ddp.module.trunk.weight.requires_grad_(False)
    sent.clear()
    try:
        _step(ddp, opt, rank, 1)
        _step(ddp, opt, rank, 2)
    except RuntimeError as exc:
        return {"error": str(exc).split(".")[0], "sent": sent}
    return {"error": None, "sent": sent}


def _unfreeze_without_refreeze(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    net = Net()
    net.trunk.weight.requires_grad_(False)
    ddp = DDP(net)
    sent: list[int] = []
    ddp.register_comm_hook(sent, counting_hook)
    net.trunk.weight.requires_grad_(True)
    x, y = batch(rank, 0)
    F.mse_loss(ddp(x, use_b=True), y).backward()
    grads = [torch.empty_like(net.trunk.weight.grad) for _ in range(world)]
    dist.all_gather(grads, net.trunk.weight.grad)
    return {"sent": sum(sent), "synced": torch.equal(grads[0], grads[1])}


def _flips_without_refreeze(rank: int, world: int) -> list[dict]:
    return [
        _freeze_without_refreeze(rank, world, {}),
        _freeze_without_refreeze(rank, world, {"find_unused_parameters": True}),
        _unfreeze_without_refreeze(rank, world),
    ]


def test_measured_freezing_after_wrap_without_refreeze(tmp_path) -> None:
    """What refreeze exists for, on this torch: a flip after wrapping keeps communicating, breaks, or never syncs."""
    everything = _nbytes(Net())
    default, find_unused, unfrozen = run_ranks(_flips_without_refreeze, tmp_path)[0]
    assert default["error"] == "Expected to have finished reduction in the prior iteration before starting a new one"
    assert default["sent"] == []  # the step after the freeze all-reduced nothing: its grads were not synced
    assert find_unused["error"] is None and sum(find_unused["sent"]) == 2 * everything  # frozen weight still sent
    # Unfrozen after wrapping: never all-reduced, so the ranks' grads differ.
    assert unfrozen == {"sent": everything - _nbytes(Net(), ["trunk.weight"]), "synced": False}


# --------------------------------------------------------------------------------------------- refreeze


def _keeps_state_and_stops_communication(rank: int, world: int, flags: dict) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net(), **flags)
    sent: list[int] = []
    ddp.register_comm_hook(sent, counting_hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    for step in range(2):
        _step(ddp, opt, rank, step)
    sent.clear()
    _step(ddp, opt, rank, 2)
    before_bytes = sum(sent)
    params_before = list(ddp.module.parameters())
    state_before = copy.deepcopy(opt.state_dict())

    new = refreeze(ddp, opt, freeze=[ddp.module.trunk, "block.0"])

    same_state = _state_equal(state_before, opt.state_dict())
    sent.clear()
    _step(new, opt, rank, 3)
    return {
        "new": new is not ddp and new.module is ddp.module,
        "identity": all(a is b for a, b in zip(params_before, new.module.parameters())),
        "state_bit_identical": same_state,
        "before": before_bytes,
        "after": sum(sent),
        "kwargs_equal": _kwargs(new) == _kwargs(ddp),
        "reducer_tensors": new._get_ddp_logging_data()["num_parameter_tensors"],
        "frozen_unchanged": True,
    }


def _kwargs(ddp: DDP) -> dict:
    return {k: v for k, v in constructor_kwargs(ddp).items() if k != "process_group"} | {
        "process_group": id(ddp.process_group)
    }


def _state_equal(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        if sa.keys() != sb.keys() or not all(torch.equal(sa[n], sb[n]) for n in sa):
            return False
    return True


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"gradient_as_bucket_view": True, "bucket_cap_mb": 1e-4},
        {"find_unused_parameters": True, "broadcast_buffers": False},
    ],
)
def test_refreeze_keeps_optimizer_state_and_stops_communicating_frozen_params(tmp_path, flags) -> None:
    net = Net()
    everything = _nbytes(net)
    kept = everything - _nbytes(net, FROZEN)
    for res in run_ranks(_keeps_state_and_stops_communication, tmp_path, args=(flags,)):
        assert res["new"] and res["identity"] and res["state_bit_identical"] and res["kwargs_equal"]
        assert (res["before"], res["after"]) == (everything, kept)  # reduced by exactly the frozen share
        assert res["reducer_tensors"] == 8 - len(FROZEN)


def _carried_over(rank: int, world: int) -> list[tuple]:
    group = dist.new_group(list(range(world)))
    out = []
    for kwargs in (
        {},
        {
            "process_group": group,
            "static_graph": True,
            "gradient_as_bucket_view": True,
            "bucket_cap_mb": 2,
            "broadcast_buffers": False,
            "dim": 1,
        },
    ):
        torch.manual_seed(0)
        ddp = DDP(Net(), **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        _step(ddp, opt, rank, 0)
        new = refreeze(ddp, opt, freeze="trunk")
        attrs = (
            "find_unused_parameters",
            "static_graph",
            "gradient_as_bucket_view",
            "bucket_bytes_cap",
            "bucket_bytes_cap_default",
            "forward_sync_buffers" if HAS_FORWARD_SYNC_BUFFERS else "broadcast_buffers",
            "dim",
            "device_ids",
            "output_device",
        )
        out.append(
            tuple(getattr(new, a) == getattr(ddp, a) for a in attrs)
            + (new.process_group is ddp.process_group, new.static_graph == ("static_graph" in kwargs))
        )
    return out


def test_constructor_arguments_are_carried_over(tmp_path) -> None:
    for res in run_ranks(_carried_over, tmp_path):
        assert res == [(True,) * 11] * 2


def _match_reference(rank: int, world: int, direction: str, flags: dict) -> dict:
    set_to_none = flags.pop("set_to_none", True)

    def _step(ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
        x, y = batch(rank, step)
        F.mse_loss(ddp(x, use_b=True), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)  # False: frozen params would keep zero grads, and AdamW moves them

    torch.manual_seed(0)
    net = Net()
    if direction == "unfreeze":
        for n, p in net.named_parameters():
            p.requires_grad_(n not in FROZEN)
    ddp = DDP(net, **flags)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        _step(ddp, opt, rank, step)

    # The reference: the same weights and optimizer state, with the new trainable set before wrapping.
    ref_net = copy.deepcopy(net)
    for n, p in ref_net.named_parameters():
        p.requires_grad_((n not in FROZEN) if direction == "freeze" else True)
        p.grad = None
    ref_opt = torch.optim.AdamW(ref_net.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict aliases same-device tensors
    ref = DDP(ref_net, **flags)

    if direction == "freeze":
        ddp = refreeze(ddp, opt, freeze=FROZEN)
    else:
        ddp = refreeze(ddp, opt, unfreeze=lambda name, p: name in FROZEN)
    equal_after = []
    for step in range(3, 6):
        _step(ddp, opt, rank, step)
        _step(ref, ref_opt, rank, step)
        equal_after.append(all(torch.equal(a, b) for a, b in zip(net.parameters(), ref_net.parameters())))
    frozen_moved = any(
        not torch.equal(dict(net.named_parameters())[n], dict(ref_net.named_parameters())[n]) for n in FROZEN
    )
    return {"equal_after": equal_after, "frozen_moved": frozen_moved}


@pytest.mark.parametrize(
    ("direction", "flags"),
    [("freeze", {}), ("freeze", {"gradient_as_bucket_view": True, "set_to_none": False}), ("unfreeze", {})],
)
def test_next_steps_match_a_run_with_that_trainable_set_from_the_start(tmp_path, direction, flags) -> None:
    for res in run_ranks(_match_reference, tmp_path, args=(direction, flags)):
        assert res == {"equal_after": [True, True, True], "frozen_moved": False}


def _refuses_divergence(rank: int, world: int, what: str) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    _step(ddp, opt, rank, 0)
    if rank == world - 1:
        with torch.no_grad():
            if what == "weights":
                ddp.module.head_a.bias[0] += 1e-4
            else:
                opt.state[ddp.module.block[0].weight]["exp_avg"][0, 0] += 1e-4
    with pytest.raises(ReplicaDivergenceError) as info:
        refreeze(ddp, opt, freeze="trunk")
    _step(ddp, opt, rank, 1)  # nothing changed: the old DDP still trains
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
        assert "replaced by ddp_doctor.refreeze() at" in message and "test_refreeze.py" in message


def _guard_follows(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = guard(ddp, every=2, on_problem="raise", optimizer=opt)
    _step(ddp, opt, rank, 0)
    ddp = refreeze(ddp, opt, freeze="trunk")
    for step in range(1, 5):
        _step(ddp, opt, rank, step)  # no flip reported: the guard now watches the new DDP
    ddp.module.head_b.weight.requires_grad_(False)
    code = None
    try:
        _step(ddp, opt, rank, 5)
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
    _step(ddp, opt, rank, 0)  # nothing changed on any rank
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


# ------------------------------------------------------------------------------------------ progressive


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
        _step(ddp, opt, rank, step)
        per_step.append(sum(sent))
    return {"bytes": per_step, "rebuilt": rebuilt, "applied": schedule.applied, "pending": schedule.pending}


def test_progressive_freeze_by_step(tmp_path) -> None:
    net = Net()
    full = _nbytes(net)
    no_trunk = full - _nbytes(net, ["trunk.weight", "trunk.bias"])
    no_block = no_trunk - _nbytes(net, ["block.0.weight", "block.0.bias"])
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
