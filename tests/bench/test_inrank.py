"""The in-rank pieces of `ddp-doctor bench` that let candidates share one launch: DDP rebuilt in place on the
script's own object, the starting point restored, and the plan/log files both sides read. Real gloo groups."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.bench.candidates import Config
from ddp_doctor.bench.inplace import Snapshot, rebuild_in_place
from ddp_doctor.bench.plan import BenchLog, BenchPlan, Block, judge_report, round_end, round_order
from ddp_doctor.core.findings import Finding, ParamRef, Recommendation, Timing
from ddp_doctor.observation.wrapstate import constructor_kwargs
from ddp_doctor.report.model import Report


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 1)  # never used: both flags off cannot work unless it is frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _rebuilds(rank: int, world: int) -> dict[str, tuple]:
    torch.manual_seed(rank)  # different weights: DDP's constructor broadcasts rank 0's
    model = Net()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    calls: list[int] = []
    ddp.register_forward_pre_hook(lambda _m, _a: calls.append(1))  # the script's own hook on its wrapper
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(10 + rank)

    def step() -> torch.Tensor:
        loss = F.cross_entropy(ddp(torch.randn(4, 8, generator=g)), torch.randint(0, 2, (4,), generator=g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return torch.cat([p.grad.reshape(-1) for p in (model.body.weight, model.head.weight)])

    step()
    base = constructor_kwargs(ddp)
    trainable = [p.requires_grad for p in model.parameters()]
    out = {}
    for name, config in (
        ("static_graph", Config(static_graph=True)),
        ("frozen aux", Config(freeze_before_wrap=("aux.weight", "aux.bias"))),
        ("find_unused 1mb", Config(find_unused_parameters=True, bucket_cap_mb=1.0)),
    ):
        before = len(calls)
        flags = rebuild_in_place(ddp, base, config, trainable)
        grads = torch.stack([step() for _ in range(3)])
        every = [torch.empty_like(grads) for _ in range(world)]
        dist.all_gather(every, grads)
        out[name] = (
            bool(ddp.static_graph),
            bool(ddp.find_unused_parameters),
            ddp.bucket_bytes_cap / 2**20,
            flags,
            all(torch.equal(every[0], e) for e in every),
            len(calls) - before,
            model.aux.weight.requires_grad,
            ddp.training,
        )
    return out


def test_rebuild_in_place_applies_each_config_and_keeps_the_scripts_object_training(tmp_path: Path) -> None:
    for result in run_ranks(_rebuilds, tmp_path):
        static, frozen, unused = result["static_graph"], result["frozen aux"], result["find_unused 1mb"]
        # (static_graph, find_unused, bucket MB, trainable flags, grads equal across ranks, hook calls, aux trains)
        assert static[:3] == (True, False, 25.0) and static[3] == [True] * 6 and static[4] and static[5] == 3
        assert frozen[:2] == (False, False) and frozen[3] == [True, True, True, True, False, False]
        assert frozen[4] and frozen[5] == 3 and frozen[6] is False  # both flags off works: aux was frozen first
        assert unused[:3] == (False, True, 1.0) and unused[4] and unused[6] is True  # the freeze is undone
        assert all(r[7] for r in result.values())


def test_snapshot_restores_weights_buffers_and_optimizer_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def train() -> list[torch.Tensor]:
        for x in data:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]

    snap = Snapshot.take(model, opt)
    first = train()
    opt.param_groups[0]["lr"] = 0.5  # a scheduler moved it
    train()
    snap.restore(model, opt)
    assert opt.param_groups[0]["lr"] == 1e-2 and len(opt.state) == 0
    again = train()  # from the same starting point: the same trajectory
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_plan_and_log_round_trip(tmp_path: Path) -> None:
    plan = BenchPlan(
        steps=4,
        rounds=3,
        candidates=[("recommended", Config(freeze_before_wrap=("a.weight",)))],
        pending=["recommended"],
        history={"recommended": [0.01]},
        budget_s=60.0,
    )
    assert BenchPlan.from_dict(plan.to_dict()) == plan
    log = BenchLog(
        candidates=plan.candidates,
        blocks=[Block(round=0, name="recommended", status="timing", step_s=[0.1])],
        first_step_at=5.0,
    )
    log.write(tmp_path)
    back = BenchLog.read(tmp_path)
    assert back == log and back.current is back.blocks[0]


def test_round_end_stops_on_the_maximum_the_budget_or_nothing_left() -> None:
    configs = {"recommended": Config(), "user": Config(find_unused_parameters=True)}
    tie = {"recommended": [1.0, 1.0], "user": [1.0, 1.01]}
    assert round_end(tie, configs, rounds_done=2, rounds=6, budget_spent=False) == ""
    assert round_end(tie, configs, rounds_done=2, rounds=2, budget_spent=False) == "the maximum of 2"
    assert "budget of 60 s" in round_end(tie, configs, rounds_done=2, rounds=6, budget_spent=True, budget_s=60.0)
    assert round_end({}, {}, rounds_done=1, rounds=6, budget_spent=False) == "no candidate is left"


def test_rounds_rotate_their_order() -> None:
    live = ["user", "recommended", "static_graph"]
    assert [round_order(live, r) for r in range(4)] == [
        live,
        ["recommended", "static_graph", "user"],
        ["static_graph", "user", "recommended"],
        live,
    ]
    assert round_order([], 3) == []


def _report(unused: list[str], errors: tuple[str, ...] = ()) -> Report:
    findings = [Finding(code=c, severity="error", title=c, detail="") for c in errors]
    if unused:
        findings.append(
            Finding(
                code="unused-parameters",
                severity="warning",
                title="unused",
                detail="",
                params=[ParamRef(name=n, numel=1) for n in unused],
            )
        )
    return Report(
        tool_version="0",
        torch_version="2.13",
        backend="gloo",
        world_size=2,
        steps_observed=4,
        ddp_config={},
        findings=findings,
        timing=Timing(),
        recommendation=Recommendation(
            find_unused_parameters=False,
            static_graph=False,
            gradient_as_bucket_view=False,
            freeze_before_wrap=[],
            reason="",
            verified=False,
        ),
    )


def test_a_block_is_judged_on_errors_and_on_the_checks_used_set_except_under_find_unused() -> None:
    assert judge_report(_report([]), Config(), set()) == (True, "")
    correct, reason = judge_report(_report([], errors=("grads-not-synced",)), Config(), set())
    assert not correct and reason.startswith("grads-not-synced")
    # A block that ran where the script no longer uses its aux head (a later step of a shared launch):
    correct, reason = judge_report(_report(["aux.weight"]), Config(static_graph=True), set())
    assert not correct and "used set differs" in reason
    assert judge_report(_report(["aux.weight"]), Config(find_unused_parameters=True), set()) == (True, "")
    assert judge_report(_report(["aux.weight"]), Config(freeze_before_wrap=("aux.weight",)), set()) == (True, "")
    # An error in the second DDP model's report (a GAN's critic) makes the candidate incorrect too.
    correct, reason = judge_report(_report([]), Config(), set(), [_report([], errors=("reduction-error",))])
    assert not correct and reason.startswith("reduction-error")
