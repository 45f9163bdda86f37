"""Where the step time goes, on real gloo groups: a slow dataset read without workers gives `input-bound` naming
the loader, the same with enough workers does not; a rank with extra work each step gives `straggler-rank` naming
it; clean loops give neither, run several times on this (loaded, shared) machine."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from checkrun import SCRIPTS, check
from dist import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_doctor import observe

pytestmark = pytest.mark.serial

TIMING = {"input-bound", "straggler-rank"}
STEPS = 8


def _loop(rank: int, world: int, pattern: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    sampler = DistributedSampler(data)
    sampler.set_epoch(0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    with observe(ddp, optimizer=opt, steps=STEPS) as doctor:
        for x, y in loader:
            if pattern == "rank1_extra_work" and rank == 1:
                time.sleep(0.03)  # an augmentation only rank 1 runs (a sleep: the same on a busy machine)
            F.cross_entropy(ddp(x), y).backward()
            if pattern == "log_every_step":
                loss = torch.tensor([1.0])
                dist.all_reduce(loss)
            opt.step()
            opt.zero_grad()
    report = doctor.report()
    return {
        "codes": sorted(report.codes),
        "findings": {f.code: (f.ranks, f.title, f.detail) for f in report.findings},
        "labels": {f.code: f.labels for f in report.findings},
        "per_rank": [t.to_dict() for t in report.timing.per_rank],
    }


def test_a_rank_with_extra_work_each_step_is_named_a_straggler(tmp_path) -> None:
    got = run_ranks(_loop, tmp_path, args=("rank1_extra_work",))
    assert got[0]["codes"] == got[1]["codes"]
    assert "straggler-rank" in got[0]["codes"], got[0]
    ranks, _, _ = got[0]["findings"]["straggler-rank"]
    assert ranks == [1]
    assert got[0]["labels"]["straggler-rank"] == {"clock": "host", "phase": "data_wait"}  # between steps
    assert "input-bound" not in got[0]["codes"]  # one rank waiting between steps is not the group waiting for data
    per_rank = got[0]["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    # Rank 0 waits for rank 1 in DDP's all-reduce; rank 1 spends its time before the forward.
    assert per_rank[0]["comm_wait_s"] > 0.015 and per_rank[1]["data_wait_s"] > 0.025


def test_extra_computation_on_rank_1_through_check_names_rank_1(tmp_path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "straggler.py")], tmp_path)
    f = run.finding("straggler-rank")
    assert f["ranks"] == [1] and "rank 1" in f["title"], f
    assert not run.errors() and "input-bound" not in run.codes


@pytest.mark.parametrize("attempt", range(3))
@pytest.mark.parametrize("pattern", ["plain", "log_every_step"])
def test_clean_loops_show_neither_timing_finding(tmp_path, pattern: str, attempt: int) -> None:
    got = run_ranks(_loop, tmp_path, args=(pattern,))
    assert not set(got[0]["codes"]) & TIMING, got[0]
    assert len(got[0]["per_rank"]) == 2 and got[0]["per_rank"][0]["steps"] == STEPS - 1


def test_a_slow_dataset_without_workers_is_input_bound_and_named(tmp_path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "slow_loader.py")], tmp_path)
    assert run.rc == 0, run.output  # a warning: below the default --fail-on error
    f = run.finding("input-bound")
    assert f["ranks"] == [0, 1]
    assert "SlowDecode created at tests/scripts/slow_loader.py:" in f["detail"], f["detail"]
    assert "num_workers=0" in f["detail"] and "pin_memory=False" in f["detail"]
    assert "num_workers=4 or more" in f["fix"]
    assert "straggler-rank" not in run.codes
    for r in run.report["timing"]["per_rank"]:
        assert r["data_wait_s"] > 0.5 * r["step_s"], r


def test_the_same_dataset_with_enough_workers_is_not(tmp_path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "slow_loader.py"), "--workers", "8"], tmp_path)
    assert not run.codes & TIMING, run.output
    assert run.rc == 0, run.output


def _comm_seconds(rank: int, world: int) -> tuple[float, float, float, float]:
    """Rank 1 sleeps 0.3 s before a DTensor's `full_tensor()` (a functional all-reduce, as a clip's norm) and again
    before the script's `dist.all_reduce`: rank 0 waits in each, and its clock counts both waits. Once stopped, the
    clock counts no more waits and leaves the FSDP2 groups as they were."""
    import time

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    from ddp_doctor.observation.sharding import sharded_model_of
    from ddp_doctor.observation.step_clock import CommClock

    model = fully_shard(nn.Linear(4, 4))
    clock = CommClock(sharded_model_of(model).param_groups())
    assert clock.timed
    mesh = init_device_mesh("cpu", (world,))
    seen = []
    for collective in ("functional", "script"):
        before = clock.seconds
        if rank == 1:
            time.sleep(0.3)
        if collective == "functional":
            DTensor.from_local(torch.ones(2), mesh, [Partial()]).full_tensor()
        else:
            dist.all_reduce(torch.ones(1))
        seen.append(clock.seconds - before)
    clock.stop()
    stopped = clock.seconds
    if rank == 1:
        time.sleep(0.3)
    dist.all_reduce(torch.ones(1))
    DTensor.from_local(torch.ones(2), mesh, [Partial()]).full_tensor()
    groups = sharded_model_of(model).param_groups()
    unwrapped = all(name not in vars(g) for g in groups for name in CommClock.METHODS)
    return seen[0], seen[1], clock.seconds - stopped, float(unwrapped)


def test_the_comm_clock_counts_a_functional_collectives_wait_and_the_scripts_own(tmp_path) -> None:
    waited = run_ranks(_comm_seconds, tmp_path)
    # rank 0 waited for rank 1's sleep of 0.3 s in both; rank 1 came last and waited less
    assert all(first >= 0.25 and last < first for first, last in zip(waited[0][:2], waited[1][:2])), waited
    # stopped: the same waits count nothing, and the groups' methods are their class's again
    assert [w[2:] for w in waited] == [(0.0, 1.0), (0.0, 1.0)], waited
