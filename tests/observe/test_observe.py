"""observe(): bad input, step counting, zero cost after exit, the communication budget, and the public names. How a
rank explains its own failure is tests/observe/test_observe_failures.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from ddpsteps import sgd_model, train_step
from dist import run_ranks
from scenarios import batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_doctor
from ddp_doctor import (
    InvalidArgumentError,
    NotDDPModelError,
    NoTrainableParametersError,
    ProcessGroupNotInitializedError,
    ReportTimeoutError,
    observe,
)


def test_plain_module_is_rejected() -> None:
    with pytest.raises(NotDDPModelError, match=r"got .*Linear.*Wrap it first"):
        observe(nn.Linear(2, 2))
    with pytest.raises(NotDDPModelError, match="got builtins.str"):
        observe("model")  # type: ignore[arg-type]


def _sharded_model(rank: int, world: int) -> str:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model)
    with pytest.raises(NotDDPModelError) as info:
        ddp_doctor.guard(model)
    return str(info.value)


def test_guard_rejects_an_fsdp2_model_without_the_advice_to_wrap_it_in_ddp(tmp_path) -> None:
    """guard() watches DDP models; DDP around a sharded model fails in DDP's constructor: the error points at
    `ddp-doctor check` instead (observe() follows sharded models: tests/fsdp2/test_observe_sharded.py)."""
    message = run_ranks(_sharded_model, tmp_path, world_size=1)[0]
    assert "the torch.nn.modules.container.Sequential given is sharded with FSDP2" in message, message
    assert "ddp-doctor check" in message and "Wrap it first" not in message, message


def _no_process_group(rank: int, world: int) -> str:
    ddp, _ = sgd_model()
    dist.destroy_process_group()
    with pytest.raises(ProcessGroupNotInitializedError, match="init_process_group") as info:
        observe(ddp)
    return str(info.value)


def test_observe_without_process_group(tmp_path) -> None:
    [message] = run_ranks(_no_process_group, tmp_path, world_size=1)
    assert "torchrun" in message


def _nothing_trainable(rank: int, world: int) -> str:
    ddp, _ = sgd_model()
    for p in ddp.parameters():
        p.requires_grad_(False)
    with pytest.raises(NoTrainableParametersError, match="8 parameters and none requires a gradient") as info:
        observe(ddp)
    return info.value.code


def test_nothing_trainable(tmp_path) -> None:
    assert run_ranks(_nothing_trainable, tmp_path) == ["no-trainable-parameters"] * 2


def _bad_arguments(rank: int, world: int) -> None:
    ddp, _ = sgd_model()
    with pytest.raises(InvalidArgumentError, match="optimizer must be a torch.optim.Optimizer"):
        observe(ddp, optimizer="sgd")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="steps must be a positive int or None, got 0"):
        observe(ddp, steps=0)
    doctor = observe(ddp)
    with doctor, pytest.raises(InvalidArgumentError, match="inside the observe"):
        doctor.report()


def test_bad_arguments(tmp_path) -> None:
    run_ranks(_bad_arguments, tmp_path, world_size=1)


def _report_on_one_rank(rank: int, world: int) -> str | None:
    ddp, opt = sgd_model()
    with observe(ddp, optimizer=opt) as doctor:
        train_step(ddp, opt, rank, 0)
    if rank == 1:
        return None  # rank 1 forgets report()
    with pytest.raises(ReportTimeoutError) as info:
        doctor.report(timeout=2)
    return str(info.value)


def test_report_on_one_rank_times_out_and_names_the_missing_rank(tmp_path) -> None:
    message, _ = run_ranks(_report_on_one_rank, tmp_path, timeout=40)
    assert "rank(s) [1] of world size 2" in message and "call it on every rank" in message


def _hook_counts(ddp: DDP, opt: torch.optim.Optimizer) -> tuple[int, ...]:
    modules = (ddp, ddp.module)
    return (
        sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in modules),
        sum(len(p._post_accumulate_grad_hooks or {}) for p in ddp.parameters()),
        len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks),
    )


def _zero_cost_after_exit(rank: int, world: int) -> dict:
    observed, opt_a = sgd_model()
    plain = DDP(copy.deepcopy(observed.module))
    opt_b = torch.optim.SGD(plain.parameters(), lr=0.1)
    before = _hook_counts(observed, opt_a)
    during = None
    identical = True
    with observe(observed, optimizer=opt_a) as doctor:
        for step in range(3):
            during = during or _hook_counts(observed, opt_a)
            train_step(observed, opt_a, rank, step)
            train_step(plain, opt_b, rank, step)
    after = _hook_counts(observed, opt_a)
    for step in range(3, 6):
        for model in (observed, plain):
            train_step(model, None, rank, step)
        identical &= all(torch.equal(a.grad, b.grad) for a, b in zip(observed.parameters(), plain.parameters()))
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    identical &= all(torch.equal(a, b) for a, b in zip(observed.parameters(), plain.parameters()))
    doctor.report(timeout=20)
    return {"before": before, "during": during, "after": after, "identical": identical}


def test_every_hook_is_gone_after_exit_and_training_is_bit_identical(tmp_path) -> None:
    for r in run_ranks(_zero_cost_after_exit, tmp_path):
        assert r["during"] > r["before"], "observe() installed no hooks?"
        assert r["after"] == r["before"]
        assert r["identical"], "grads or weights differ from a run that was never observed"


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "broadcast",
    "barrier",
    "all_gather_object",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "reduce",
)


def _communication(rank: int, world: int) -> dict:
    ddp, opt = sgd_model()
    calls: dict[str, list] = {name: [] for name in _COLLECTIVES}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}
    # Both namespaces: torch.distributed's re-export and distributed_c10d's globals, through which torch's own
    # helpers (all_gather_object, ...) and any `from torch.distributed.distributed_c10d import ...` call them.
    namespaces = (dist, c10d)

    def counting(name):
        def wrapper(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            calls[name].append(tuple(tensors[0].shape) if tensors else None)
            return originals[name](*args, **kwargs)

        return wrapper

    for name in _COLLECTIVES:
        for ns in namespaces:
            setattr(ns, name, counting(name))
    try:
        with observe(ddp, optimizer=opt) as doctor:
            for step in range(4):
                train_step(ddp, opt, rank, step)
        during = sum(len(v) for v in calls.values())
        doctor.report(timeout=20)
    finally:
        for name, fn in originals.items():
            for ns in namespaces:
                setattr(ns, name, fn)
    return {"during": during, "report": {k: len(v) for k, v in calls.items() if v}, "shapes": calls["all_reduce"]}


def test_no_collectives_during_steps_and_fixed_shape_reductions_at_report(tmp_path) -> None:
    a, b = run_ranks(_communication, tmp_path)
    assert a["during"] == b["during"] == 0
    # The report's exchange is reductions only (issue #15: no gather, whose volume grows with the world size).
    assert set(a["report"]) == {"all_reduce"} and a["report"] == b["report"]
    assert a["shapes"] == b["shapes"], "collective shapes depend on the rank"


def _no_optimizer(rank: int, world: int) -> dict:
    ddp, _ = sgd_model()
    with observe(ddp) as doctor:
        for step in range(3):
            with ddp.no_sync():
                train_step(ddp, None, rank, step)
            train_step(ddp, None, rank, step)  # the synced micro-step ends the step
            ddp.zero_grad()
    report = doctor.report(timeout=20)
    return {"steps": report.steps_observed, "codes": sorted(report.codes)}


def test_without_optimizer_a_step_is_a_synced_backward(tmp_path) -> None:
    assert run_ranks(_no_optimizer, tmp_path) == [{"steps": 3, "codes": []}] * 2


def _limited_steps(rank: int, world: int, auto: bool) -> dict:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    ddp, opt = sgd_model(find_unused_parameters=True)
    theirs = []
    with observe(ddp, optimizer="auto" if auto else opt, steps=2) as doctor:
        # A library's own step hooks, registered after observe()'s: the steps end inside observe()'s hook, and
        # removing it there made torch raise "OrderedDict mutated during iteration" in this loop's opt.step().
        calls = []
        theirs.append(opt.register_step_post_hook(lambda *_: calls.append(1)))
        theirs.append(register_optimizer_step_post_hook(lambda *_: calls.append(1)))
        for step in range(5):
            train_step(ddp, opt, rank, step, use_b=step < 2)  # head_b unused after the observed steps: not seen
        finished = doctor.finished
    hooks_left = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    for handle in theirs:
        handle.remove()
    report = doctor.report(timeout=20)
    return {
        "finished": finished,
        "steps": report.steps_observed,
        "codes": sorted(report.codes),
        "their_hooks_ran": len(calls),
        "hooks_left": hooks_left,
    }


@pytest.mark.parametrize("auto", [False, True], ids=["optimizer", "auto"])
def test_steps_limit_detaches_after_k_steps(tmp_path, auto: bool) -> None:
    """`steps=2` ends the observed steps inside observe()'s optimizer hook, with another hook after it (ground
    truth: before the fix, torch raised *OrderedDict mutated during iteration* in the script's opt.step()): the
    script's steps go on, the other hooks run every step, and at the block's end only the script's hook is left."""
    expected = {"finished": True, "steps": 2, "codes": ["find-unused-unneeded"], "their_hooks_ran": 10, "hooks_left": 1}
    assert run_ranks(_limited_steps, tmp_path, args=(auto,)) == [expected] * 2


def _beside_own_optimizer(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    ddp, opt = sgd_model()
    temp = nn.Parameter(torch.zeros(()))  # a learnable loss temperature beside the model, under an Adam of its own
    own = torch.optim.Adam([temp], lr=0.01)
    # Neighbours that stay clean: a second DDP model nobody observes, and a model sharded with FSDP2 (its DTensor
    # shards differ across ranks by design), each under an optimizer of its own.
    torch.manual_seed(1)
    other = DDP(nn.Linear(8, 8))
    sharded = fully_shard(nn.Linear(8, 8))
    others = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (other, sharded)]
    with warnings.catch_warnings(record=True) as caught, observe(ddp, optimizer=opt, steps=4) as doctor:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = batch(rank, step)
            F.mse_loss(ddp(x, use_b=True) / temp.exp(), y).backward()
            (other(x).sum() + sharded(x).sum()).backward()
            for o in (opt, own, *others):
                o.step()
                o.zero_grad()
    report = doctor.report(timeout=20)
    found = [f for f in report.findings if f.code == "unregistered-parameters"]
    return {
        "found": [(f.severity, [p.name for p in f.params], f.steps) for f in found],
        "outside_model": report.compared["outside_model"],
        # the FSDP2 model runs beside the DDP model: no DTensor shard is compared (they differ by design)
        "beside": (
            report.compared["modules_beside"],
            [f.code for f in report.findings if f.code == "replica-divergence"],
        ),
        "warned": [f"{w.category.__name__}: {w.message}"[:80] for w in caught],
        # (the DataLoader listener's global hook stays for the process's life, by design: not a step hook)
        "global_hooks_left": sum(type(h).__name__ == "_StepHook" for h in _global_optimizer_pre_hooks.values()),
    }


def test_a_tensor_under_an_optimizer_of_its_own_is_compared_with_the_optimizer_given(tmp_path) -> None:
    """observe(model, optimizer) follows the given optimizer's steps, and notes the others: `temp`, stepped by its
    own Adam from each rank's gradient, differs across ranks (from step 1: the Adam is known from its first step,
    after step 0 closed), and the global hook that noted it is gone after the block. Beside it, a DDP model nobody
        observes and an FSDP2 model, each under its own optimizer, are neither compared as tensors beside the model nor
    named. Before: `unregistered-parameters` named `sharded.weight` and `sharded.bias` beside `temp` (the FSDP2
    model's local shards, which differ across ranks by design), 5 tensors compared beside the model instead of 1,
    and observe_overhead's DDP ratio went from 1.8x to 4.1x with such models in the process."""
    expected = {
        "found": [("error", ["temp"], [1])],
        "outside_model": 1,
        "beside": (0, []),
        "warned": [],
        "global_hooks_left": 0,
    }
    assert run_ranks(_beside_own_optimizer, tmp_path) == [expected] * 2


def test_public_names_are_the_functions_and_the_implementation_modules_are_private() -> None:
    """`from ddp_doctor import guard` is the function (rich's pattern: private implementation modules, public names
    in the package), so no public module of the same name can shadow it or be shadowed by it."""
    import importlib
    import inspect
    import types

    from ddp_doctor import guard, observe, refreeze

    for fn, module in (
        (observe, "ddp_doctor.doctor"),
        (guard, "ddp_doctor.fixes.guard"),
        (refreeze, "ddp_doctor.fixes.refreeze"),
    ):
        assert inspect.isfunction(fn) and fn.__module__.startswith(module), (fn, fn.__module__)
        assert isinstance(importlib.import_module(module), types.ModuleType)
        name = fn.__name__
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"ddp_doctor.{name}")
    assert set(ddp_doctor.__all__) >= {"observe", "guard", "refreeze", "sync_gradients", "Doctor", "Guard"}
