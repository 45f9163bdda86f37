"""refreeze(): optimizer state kept bit-identical, frozen params no longer communicated (bytes counted through a
DDP comm hook), DDP's constructor arguments carried over, and the next steps equal to a run frozen from the start.
Its refusals are tests/fixes/test_refreeze_refusals.py, the schedule of progressive_freeze()
tests/fixes/test_progressive_freeze.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddpsteps import counting_hook, nbytes, train_step
from dist import run_ranks
from scenarios import Net, batch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import refreeze
from ddp_doctor.core.compat import HAS_FORWARD_SYNC_BUFFERS
from ddp_doctor.observation.wrapstate import constructor_kwargs

FROZEN = ["trunk.weight", "trunk.bias", "block.0.weight", "block.0.bias"]


# ------------------------------------------------------------------------------------------ DDP, measured


def _freeze_without_refreeze(rank: int, world: int, flags: dict) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net(), **flags)
    sent: list[int] = []
    ddp.register_comm_hook(sent, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_step(ddp, opt, rank, 0)
    ddp.module.trunk.weight.requires_grad_(False)
    sent.clear()
    try:
        train_step(ddp, opt, rank, 1)
        train_step(ddp, opt, rank, 2)
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
    everything = nbytes(Net())
    default, find_unused, unfrozen = run_ranks(_flips_without_refreeze, tmp_path)[0]
    assert default["error"] == "Expected to have finished reduction in the prior iteration before starting a new one"
    assert default["sent"] == []  # the step after the freeze all-reduced nothing: its grads were not synced
    assert find_unused["error"] is None and sum(find_unused["sent"]) == 2 * everything  # frozen weight still sent
    # Unfrozen after wrapping: never all-reduced, so the ranks' grads differ.
    assert unfrozen == {"sent": everything - nbytes(Net(), ["trunk.weight"]), "synced": False}


# --------------------------------------------------------------------------------------------- refreeze


def _keeps_state_and_stops_communication(rank: int, world: int, flags: dict) -> dict:
    torch.manual_seed(0)
    ddp = DDP(Net(), **flags)
    sent: list[int] = []
    ddp.register_comm_hook(sent, counting_hook)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    for step in range(2):
        train_step(ddp, opt, rank, step)
    sent.clear()
    train_step(ddp, opt, rank, 2)
    before_bytes = sum(sent)
    params_before = list(ddp.module.parameters())
    state_before = copy.deepcopy(opt.state_dict())

    new = refreeze(ddp, opt, freeze=[ddp.module.trunk, "block.0"])

    same_state = _state_equal(state_before, opt.state_dict())
    sent.clear()
    train_step(new, opt, rank, 3)
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
    everything = nbytes(net)
    kept = everything - nbytes(net, FROZEN)
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
        train_step(ddp, opt, rank, 0)
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

    def train_step(ddp: DDP, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
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
        train_step(ddp, opt, rank, step)

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
        train_step(ddp, opt, rank, step)
        train_step(ref, ref_opt, rank, step)
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
