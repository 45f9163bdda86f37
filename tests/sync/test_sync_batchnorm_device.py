"""SyncBatchNorm is advised only where it runs. Ground truth (torch 2.13.0, gloo, 2 ranks, CPU): DDP built around
a model converted with `torch.nn.SyncBatchNorm.convert_sync_batchnorm` raises ValueError "SyncBatchNorm layers only
work with GPU modules" in its constructor. Before, `batchnorm-not-synced` (and `buffer-divergence` of running
statistics under `broadcast_buffers=False`, and guard's buffer finding) advised exactly that conversion on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkrun import SCRIPTS, check
from dist import RankFailure, run_ranks
from purerecords import info, record
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor.core.records import StepCounters
from ddp_doctor.doctor.pipeline import analyze


def _converted(rank: int, world: int) -> str:
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    )
    DDP(model)
    return "built"


def test_syncbatchnorm_cannot_be_built_into_ddp_on_cpu(tmp_path: Path) -> None:
    with pytest.raises(RankFailure, match="SyncBatchNorm layers only work with GPU modules"):
        run_ranks(_converted, tmp_path)


def test_a_cpu_check_does_not_advise_syncbatchnorm(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "eval_rank0_bn.py"), "--module"], tmp_path)
    found = run.finding("batchnorm-not-synced")
    assert found["severity"] == "info" and "convert_sync_batchnorm" not in found["fix"], found


@pytest.mark.parametrize(("device", "advised"), [("cuda", True), ("cpu", False), ("", True)])
def test_syncbatchnorm_is_advised_for_gpu_modules_only(device: str, advised: bool) -> None:
    training = StepCounters(ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1, batchnorm_training=1)
    records = [record(r, [[1, 1, 1, 1]] * 2, counters=torch.tensor([training.as_list()] * 2)) for r in range(2)]
    d = analyze(info(batchnorm=["norm"], device_type=device), records)
    found = [f for f in d.findings if f.code == "batchnorm-not-synced"]
    assert len(found) == 1 and ("convert_sync_batchnorm" in found[0].fix) is advised, found
