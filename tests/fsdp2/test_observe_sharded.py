"""observe() on models sharded with FSDP2 (`fully_shard`) and the FSDP2-based `replicate`: real gloo groups of 2 and
4 ranks, the user's own loop inside the `with` block, `report()` on every rank.

Each rank also measures what the report speaks of, directly, in the same run (whether any weight changed, whether
the head differs across ranks), so a test holds the report to what happened. The ground truth under plain torchrun
(the same patterns, no doctor) is in tests/fsdp2/test_check_fsdp2.py's docstrings: an optimizer built before
`fully_shard` changes no weight in 5 steps; an unsharded root's head differs across ranks by about 5e-3 after 5
steps; sync switched off on every micro-batch changes no weight; rank 0's `torch.save(model.state_dict())` holds
rank 0's half of each parameter.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import run_ranks
from torch import nn

from ddp_doctor import InvalidArgumentError, ShardedDoctor, observe
from ddp_doctor.core.compat import replicate_module_type

STEPS = 5


def _has_replicate() -> type | None:
    """The FSDP2-based replicate's class, FSDP2 imported first (`replicate_module_type` finds none before)."""
    import torch.distributed.fsdp  # noqa: F401

    return replicate_module_type()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _build(mistake: str, api: str) -> tuple[Net, torch.optim.Optimizer]:
    if api == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    torch.manual_seed(0)
    model = Net()
    if mistake == "optimizer-before":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for block in model.blocks:
        shard(block)
    if mistake != "root-unsharded":
        shard(model)
    if mistake != "optimizer-before":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(rank: int, world: int, mistake: str, api: str, folder: str) -> dict[str, Any]:
    model, opt = _build(mistake, api)
    before = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(rank)
    with observe(model, optimizer=opt) as doctor:
        for step in range(STEPS):
            for micro in range(2):
                if mistake == "sync-off":
                    model.set_requires_gradient_sync(False)
                elif mistake == "accumulate":
                    model.set_requires_gradient_sync(micro == 1)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if mistake == "save-rank0" and step == 2 and rank == 0:
                torch.save(model.state_dict(), os.path.join(folder, "ck.pt"))
    report = doctor.report()
    after = {n: _full(p).detach() for n, p in model.named_parameters()}
    head = _full(model.head.weight).detach().clone()
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head)
    return {
        "type": type(doctor).__name__,
        "steps": doctor.steps_observed,
        "report": report.to_dict(),
        "changed": any(not torch.equal(before[n], after[n]) for n in before),
        "head_gap": max(float((h - heads[0]).abs().max()) for h in heads),
    }


def _findings(result: dict[str, Any], *levels: str) -> dict[str, dict[str, Any]]:
    return {f["code"]: f for f in result["report"]["findings"] if f["severity"] in levels}


def _same_report_on_every_rank(results: list[dict[str, Any]]) -> None:
    first = results[0]["report"]
    for r in results[1:]:
        assert r["report"]["findings"] == first["findings"]
        assert r["report"]["recommendation"] == first["recommendation"]


@pytest.mark.parametrize("mistake", ["none", "accumulate"])
def test_a_clean_fsdp2_loop_is_clean(tmp_path, mistake: str) -> None:
    """Every block and the root sharded, the optimizer built after; with accumulation, sync off on the first
    micro-batch and back on for the last. Measured in the run: the weights change, the head agrees across ranks."""
    results = run_ranks(_train, tmp_path, args=(mistake, "fully_shard", str(tmp_path)), timeout=120)
    _same_report_on_every_rank(results)
    r = results[0]
    assert r["type"] == "ShardedDoctor" and r["steps"] == STEPS
    assert r["changed"] and r["head_gap"] == 0.0
    assert r["report"]["parallelism"] == "fsdp2"
    assert not _findings(r, "error", "warning"), r["report"]["findings"]
    sharding = r["report"]["sharding"]
    assert sharding["sharded_modules"] == 3 and sharding["root_sharded"] and sharding["mesh_size"] == 2
    # The last block's parameters are freed after its forward and gathered again for its backward: advised by the
    # module's name (observe() sees no fully_shard call) and not verified (no second run here).
    rec = r["report"]["recommendation"]
    assert rec["reshard"]["module"] == "blocks.1" and rec["reshard"]["call"] is None and not rec["verified"]
    assert rec["reshard"]["site"] is None and "verification" not in rec["reshard"]
    # A forward on rank 0 alone hangs the job inside the block: observe() does not name it, and says who does.
    assert any("(`ddp-doctor check` names them when they do)" in u for u in r["report"]["unchecked"])


def test_an_optimizer_built_before_fully_shard_is_named(tmp_path) -> None:
    """Measured in the run: not one weight changed in 5 steps. The report says why, on every rank alike, without
    the optimizer's line (observe() starts after the optimizer was made; `ddp-doctor check` names it)."""
    results = run_ranks(_train, tmp_path, args=("optimizer-before", "fully_shard", str(tmp_path)), timeout=120)
    _same_report_on_every_rank(results)
    r = results[0]
    assert not r["changed"]
    errors = _findings(r, "error")
    assert list(errors) == ["optimizer-params-replaced"], r["report"]["findings"]
    assert "AdamW" in errors["optimizer-params-replaced"]["detail"]


def test_an_unsharded_root_is_named_with_its_gap(tmp_path) -> None:
    """Blocks sharded, the root not: measured in the run, the head differs across ranks after 5 steps. The report
    names the head's parameters and says they already differ."""
    results = run_ranks(_train, tmp_path, args=("root-unsharded", "fully_shard", str(tmp_path)), timeout=120)
    _same_report_on_every_rank(results)
    r = results[0]
    assert r["head_gap"] > 1e-4
    found = _findings(r, "error", "warning")
    assert list(found) == ["unsharded-params-not-synced"], r["report"]["findings"]
    names = [p["name"] for p in found["unsharded-params-not-synced"]["params"]]
    assert names == ["head.weight", "head.bias"]
    assert "differ" in found["unsharded-params-not-synced"]["detail"]


def test_sync_off_on_every_micro_batch_is_named(tmp_path) -> None:
    """set_requires_gradient_sync(False) before each micro-batch, never back on: measured, no weight changed."""
    results = run_ranks(_train, tmp_path, args=("sync-off", "fully_shard", str(tmp_path)), timeout=120)
    r = results[0]
    assert not r["changed"]
    assert "gradient-sync-off" in _findings(r, "error"), r["report"]["findings"]


def test_rank0_saving_its_shards_is_named(tmp_path) -> None:
    """Inside the block, rank 0 alone torch.save's model.state_dict(): the file holds its shards only (measured:
    a [16, 16] local shard of the [32, 16] weight)."""
    results = run_ranks(_train, tmp_path, args=("save-rank0", "fully_shard", str(tmp_path)), timeout=120)
    _same_report_on_every_rank(results)
    saved = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert tuple(saved["blocks.0.0.weight"].to_local().shape) == (16, 16)
    found = _findings(results[0], "error", "warning")
    assert list(found) == ["sharded-checkpoint-incomplete"], results[0]["report"]["findings"]
    assert "ck.pt" in found["sharded-checkpoint-incomplete"]["title"]
    assert "test_observe_sharded.py:" in found["sharded-checkpoint-incomplete"]["detail"]


def test_four_ranks(tmp_path) -> None:
    """The unsharded root on 4 ranks: every rank gets the same report, the mesh is 4."""
    results = run_ranks(
        _train, tmp_path, world_size=4, args=("root-unsharded", "fully_shard", str(tmp_path)), timeout=180
    )
    _same_report_on_every_rank(results)
    r = results[0]
    assert r["report"]["sharding"]["mesh_size"] == 4
    assert list(_findings(r, "error", "warning")) == ["unsharded-params-not-synced"]


@pytest.mark.skipif(_has_replicate() is None, reason="this torch has no FSDP2-based replicate")
@pytest.mark.parametrize("mistake", ["none", "optimizer-before"])
def test_replicate(tmp_path, mistake: str) -> None:
    """The FSDP2-based replicate: clean (the weights change, the head agrees), and the optimizer built before it
    (measured: no weight changed)."""
    results = run_ranks(_train, tmp_path, args=(mistake, "replicate", str(tmp_path)), timeout=120)
    _same_report_on_every_rank(results)
    r = results[0]
    assert r["report"]["parallelism"] == "replicate"
    found = _findings(r, "error", "warning")
    if mistake == "none":
        assert r["changed"] and r["head_gap"] == 0.0 and not found, r["report"]["findings"]
    else:
        assert not r["changed"] and list(found) == ["optimizer-params-replaced"]


def _lifecycle(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model, opt = _build("none", "fully_shard")
    state = model._get_fsdp_state()  # FSDP2's private state, to see it restored (one group or a list, by release)
    group = getattr(state, "_fsdp_param_group", None) or state._fsdp_param_groups[0]
    comm = getattr(group, "_all_gather_comm", None)
    hooks = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}
    out: dict[str, Any] = {}
    calls = []
    with observe(model, optimizer=opt, steps=2) as doctor:
        # A hook of the script's after observe()'s: the steps end inside observe()'s (tests/observe/test_observe.py).
        theirs = opt.register_step_post_hook(lambda *_: calls.append(1))
        for _ in range(4):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out["finished_inside"] = doctor.finished
    out["steps"] = doctor.steps_observed
    out["their_hook"] = (len(calls), len(opt._optimizer_step_post_hooks))
    theirs.remove()
    out["comm_restored"] = getattr(group, "_all_gather_comm", None) is comm
    out["hooks_kept"] = hooks == {
        name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()
    }
    with pytest.raises(InvalidArgumentError, match="already used"):
        doctor.start()
    empty = observe(model, optimizer=opt)
    assert isinstance(empty, ShardedDoctor)
    with empty:
        pass
    with pytest.raises(InvalidArgumentError, match="saw no step of the optimizer given") as info:
        empty.report()
    out["empty"] = str(info.value)
    other = Net()
    fully_shard(other)
    with pytest.raises(InvalidArgumentError, match="inside the observe"), observe(other) as inside:
        inside.report()
    out["report"] = doctor.report().to_dict()
    return out


def test_steps_end_the_watch_and_every_hook_is_removed(tmp_path) -> None:
    """`steps=2` stops counting after two steps (inside the block), FSDP2's all-gather is its own again, no
    forward hook or forward pre-hook stays (the gradient-shard scale's included); a used context cannot start again; a report with no step and one inside the block are
    clear errors."""
    r = run_ranks(_lifecycle, tmp_path, timeout=120)[0]
    assert r["finished_inside"] and r["steps"] == 2 and r["their_hook"] == (4, 1)
    assert r["comm_restored"] and r["hooks_kept"]
    assert r["report"]["parallelism"] == "fsdp2"


def _accelerate(rank: int, world: int) -> dict[str, Any]:
    from accelerate import Accelerator

    from ddp_doctor.integrations.accelerate import observe as accelerate_observe

    accelerator = Accelerator(cpu=True)
    model, opt = _build("none", "fully_shard")
    opt = accelerator.prepare(opt)  # an AcceleratedOptimizer around the torch one
    g = torch.Generator().manual_seed(rank)
    with accelerate_observe(model, opt) as doctor:
        for _ in range(STEPS):
            model.set_requires_gradient_sync(False)
            F.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
            opt.step()
            opt.zero_grad()
    return {"type": type(doctor).__name__, "report": doctor.report().to_dict()}


def test_accelerate_integration_follows_a_sharded_model(tmp_path) -> None:
    """ddp_doctor.integrations.accelerate.observe given a model the script sharded and an optimizer Accelerate
    prepared (Accelerate's own FSDP2 plugin shards only on GPUs: tests/fsdp2/test_check_fsdp2_gpu.py): the
    AcceleratedOptimizer is followed through the torch optimizer it steps, and the fix speaks Accelerate."""
    pytest.importorskip("accelerate")  # not in the core venvs of `make test-torch`
    results = run_ranks(_accelerate, tmp_path, timeout=120)
    _same_report_on_every_rank(results)
    r = results[0]
    assert r["type"] == "ShardedDoctor" and r["report"]["framework"] == "accelerate"
    found = _findings(r, "error", "warning")
    assert list(found) == ["gradient-sync-off"], r["report"]["findings"]
    assert "accelerator.no_sync(model)" in found["gradient-sync-off"]["fix"]


def _nested(rank: int, world: int) -> dict[str, Any]:
    from ddp_doctor.observation.shard_comms import GatherCount
    from ddp_doctor.observation.sharding import sharded_model_of

    model, opt = _build("none", "fully_shard")
    state = model._get_fsdp_state()
    group = getattr(state, "_fsdp_param_group", None) or state._fsdp_param_groups[0]
    original = group._all_gather_comm
    outer = None
    with observe(model, optimizer=opt):
        for step in range(3):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:  # a second watch wraps FSDP2's all-gathers over observe()'s (the check's, in a script)
                outer = GatherCount(sharded_model_of(model))
    assert outer is not None
    before = outer.calls
    model(torch.randn(4, 16)).square().mean().backward()
    return {"outer_kept": group._all_gather_comm._inner is original, "outer_counts": outer.calls > before}


def test_leaving_the_block_keeps_another_watchs_wrappers(tmp_path) -> None:
    """observe() inside a script under `ddp-doctor check`: both wrap FSDP2's all-gathers, observe() first. At the
    block's end it takes out its own wrapper alone; the check's goes on counting."""
    r = run_ranks(_nested, tmp_path, timeout=120)[0]
    assert r == {"outer_kept": True, "outer_counts": True}
