"""guard() as a long run lives with it: an internal failure turns it off on every rank and training goes on, bad
arguments and different models raise clearly, close() removes every hook, a guarded model copies and saves, and
follow() hands it to a DDP rebuilt by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from guardrun import capture, make_model, train_step
from scenarios import Net, batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import GuardError, InvalidArgumentError, NotDDPModelError, RankMismatchError, guard
from ddp_doctor.core.compat import HAS_INIT_SYNC
from ddp_doctor.fixes.guard import GUARD_ATTR
from ddp_doctor.fixes.guard import compare as guard_compare

# --------------------------------------------------------------------------------------------- robustness


def _internal_failure(rank: int, world: int, where: str) -> dict:
    ddp, opt = make_model()
    lines = capture()
    g = guard(ddp, every=2, optimizer=opt)
    if rank == 1:

        def broken(*_args, **_kwargs):
            raise ZeroDivisionError("injected")

        if where == "comparison":
            guard_compare.local_rows = broken  # in this rank's process only
        else:
            g._flips.check = broken
    for step in range(6):
        train_step(ddp, opt, rank, step)
    same = all(_all_equal(p.detach()) for p in ddp.parameters())
    return {
        "active": g.active,
        "checks": g.checks,
        "same": same,
        "log": lines.text,
        "failures_logged": lines.text.count("hit an internal error"),
    }


def _all_equal(t: torch.Tensor) -> bool:
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, t.contiguous())
    return all(torch.equal(copies[0], c) for c in copies[1:])


@pytest.mark.parametrize("where", ["comparison", "local hook"])
def test_an_internal_failure_turns_the_guard_off_on_every_rank_and_training_goes_on(tmp_path, where) -> None:
    results = run_ranks(_internal_failure, tmp_path, args=(where,))
    for res in results:
        assert res["active"] is False and res["same"]
    # The failing rank logs it once; at the next comparison (step 2) every rank learns it and turns off.
    assert results[1]["failures_logged"] == 1 and "ZeroDivisionError: injected" in results[1]["log"]
    assert "turned off on every rank after an internal error on rank(s) [1]" in results[0]["log"]


def _bad_arguments(rank: int, world: int) -> list[str]:
    ddp, _ = make_model()
    messages = []
    for call, error in [
        (lambda: guard(nn.Linear(2, 2)), NotDDPModelError),
        (lambda: guard(ddp, every=0), InvalidArgumentError),
        (lambda: guard(ddp, on_problem="loud"), InvalidArgumentError),
        (lambda: guard(ddp, optimizer="sgd"), InvalidArgumentError),  # type: ignore[arg-type]
    ]:
        with pytest.raises(error) as info:
            call()
        messages.append(str(info.value))
    g = guard(ddp)
    with pytest.raises(InvalidArgumentError) as info:
        guard(ddp)
    messages.append(str(info.value))
    g.close()
    guard(ddp).close()  # after close() the model can be guarded again
    return messages


def test_bad_arguments(tmp_path) -> None:
    messages = run_ranks(_bad_arguments, tmp_path)[0]
    assert "got torch.nn.modules.linear.Linear. Wrap it first" in messages[0]
    assert "every must be a positive int" in messages[1] and "got 0" in messages[1]
    assert "on_problem must be 'warn' or 'raise', got 'loud'" in messages[2]
    assert "optimizer must be a torch.optim.Optimizer or None, got str" in messages[3]
    assert "already has an active guard" in messages[4]


def _different_models(rank: int, world: int) -> str:
    torch.manual_seed(0)
    ddp = DDP(Net(), init_sync=False) if rank == 0 else DDP(Net(batchnorm=True), init_sync=False)
    with pytest.raises(RankMismatchError) as info:
        guard(ddp)
    return str(info.value)


@pytest.mark.skipif(
    not HAS_INIT_SYNC,
    reason="DDP(init_sync=False) needs torch newer than 2.4 (absent in 2.4.1); "
    "without it DDP's own initial broadcast fails first",
)
def test_different_models_raise_on_every_rank(tmp_path) -> None:
    for message in run_ranks(_different_models, tmp_path):
        assert "rank 0: 8 tensors, rank 1: 13 tensors" in message


def _hooks(ddp: DDP, opt: torch.optim.Optimizer) -> tuple[int, ...]:
    from torch.nn.modules import module as module_globals

    return (
        len(ddp._forward_pre_hooks),
        len(ddp._forward_hooks),
        len(ddp.module._forward_pre_hooks),
        len(ddp.module._state_dict_pre_hooks),
        len(opt._optimizer_step_pre_hooks),
        len(opt._optimizer_step_post_hooks),
        len(module_globals._global_forward_pre_hooks),
    )


def _close_removes_hooks(rank: int, world: int) -> tuple:
    ddp, opt = make_model()
    before = _hooks(ddp, opt)
    with guard(ddp, optimizer=opt):
        during = _hooks(ddp, opt)
    return before, during, _hooks(ddp, opt), hasattr(ddp, GUARD_ATTR)


def test_close_removes_every_hook(tmp_path) -> None:
    before, during, after, attr = run_ranks(_close_removes_hooks, tmp_path, world_size=1)[0]
    assert during != before and after == before and not attr


def _copy_and_save(rank: int, world: int, path: str) -> list[str]:
    import copy
    import io
    import pickle

    ddp, opt = make_model()
    with guard(ddp, optimizer=opt):
        train_step(ddp, opt, rank, 0)
        twin = copy.deepcopy(ddp.module)  # an EMA copy
        buffer = io.BytesIO()
        torch.save(ddp.module, buffer)  # a whole-model checkpoint
        pickle.dumps(ddp.module)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        x, _ = batch(rank, 0)
        with torch.no_grad():  # evaluation of the copies: the same function as the guarded model
            same = torch.allclose(twin(x), ddp.module(x)) and torch.allclose(loaded(x), twin(x))
        train_step(ddp, opt, rank, 1)
    return ["ok" if same else "different"]


def test_a_guarded_model_can_be_deep_copied_pickled_and_saved(tmp_path) -> None:
    assert run_ranks(_copy_and_save, tmp_path, args=(str(tmp_path),)) == [["ok"], ["ok"]]


# ------------------------------------------------------------------------------------------------ follow


def _follow_by_hand(rank: int, world: int) -> dict:
    ddp, opt = make_model()
    g = guard(ddp, every=2, on_problem="raise", optimizer=opt)
    train_step(ddp, opt, rank, 0)
    ddp.module.head_b.weight.requires_grad_(False)
    new = DDP(ddp.module)  # rebuilt by hand for the new trainable set
    g.follow(new)
    for step in range(1, 4):
        train_step(new, opt, rank, step)  # not a flip for the new DDP; the schedule carries on
    ddp.module.head_b.bias.requires_grad_(False)
    raised = None
    try:
        train_step(new, opt, rank, 4)
    except GuardError as exc:
        raised = (exc.code, exc.findings[0].param_names)
    errors = []
    for bad in (nn.Linear(2, 2), DDP(nn.Linear(2, 2))):
        try:
            g.follow(bad)
        except (NotDDPModelError, InvalidArgumentError) as exc:
            errors.append(type(exc).__name__)
    watched = (hasattr(ddp, GUARD_ATTR), getattr(new, GUARD_ATTR, None) is g)
    g.close()
    return {"raised": raised, "checks": g.checks, "steps": g.steps, "errors": errors, "watched": watched}


def test_follow_hands_the_guard_over_to_a_ddp_rebuilt_by_hand(tmp_path) -> None:
    assert (
        run_ranks(_follow_by_hand, tmp_path)
        == [
            {
                "raised": ("frozen-after-wrap", ["head_b.bias"]),
                "checks": 2,
                "steps": 4,
                "errors": ["NotDDPModelError", "InvalidArgumentError"],
                "watched": (False, True),
            }
        ]
        * 2
    )


def _flip_before_guard(rank: int, world: int) -> tuple:
    ddp, opt = make_model()
    ddp.module.head_a.bias.requires_grad_(False)  # between building DDP and guard()
    with pytest.raises(GuardError) as info:
        guard(ddp, on_problem="raise", optimizer=opt)
    return info.value.code, info.value.findings[0].param_names, hasattr(ddp, GUARD_ATTR)


def test_a_flip_before_guard_is_named_at_guard(tmp_path) -> None:
    # DDP's recorded tensor count and bytes identify the parameter (wrapstate.model_info), so it is named.
    assert run_ranks(_flip_before_guard, tmp_path) == [("frozen-after-wrap", ["head_a.bias"], False)] * 2
