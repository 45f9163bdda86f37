"""`checkpoint-same-path` and `checkpoint-module-prefix` on real gloo ranks: every rank saving one file is named with
the path, the ranks and the line; a rank-0 save behind a barrier, or one file per rank, says nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor import observe


def _save(rank: int, world: int, folder: str, how: str) -> list[dict]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    with observe(ddp, optimizer=opt, steps=3) as doctor:
        for step in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                if how == "every-rank":
                    torch.save(ddp.state_dict(), f"{folder}/last.pt")  # line 32: named in the finding
                elif how == "per-rank":
                    torch.save(ddp.module.state_dict(), f"{folder}/rank{rank}.pt")
                else:
                    if rank == 0:
                        torch.save(ddp.module.state_dict(), f"{folder}/last.pt")
                    dist.barrier()
    return [f.to_dict() for f in doctor.report().findings]


def test_every_rank_saving_one_file_is_named_with_the_path_the_ranks_and_the_line(tmp_path: Path) -> None:
    for findings in run_ranks(_save, tmp_path, args=(str(tmp_path), "every-rank")):
        same = [f for f in findings if f["code"] == "checkpoint-same-path"]
        assert len(same) == 1, findings
        f = same[0]
        assert f["severity"] == "warning" and f["ranks"] == [0, 1] and f["steps"] == [1], f
        assert f"{tmp_path}/last.pt" in f["title"] and "at tests/lockstep/test_checkpoints.py:32" in f["detail"], f
        assert "dist.barrier()" in f["fix"] and "get_rank() == 0" in f["fix"], f
        prefix = [f for f in findings if f["code"] == "checkpoint-module-prefix"]
        assert len(prefix) == 1 and prefix[0]["severity"] == "info", findings
        assert "model.module.state_dict()" in prefix[0]["fix"], prefix


@pytest.mark.parametrize("how", ["rank0-then-barrier", "per-rank"])
def test_a_guarded_save_or_one_file_per_rank_says_nothing(how: str, tmp_path: Path) -> None:
    for findings in run_ranks(_save, tmp_path, args=(str(tmp_path), how)):
        assert not [f for f in findings if f["code"].startswith("checkpoint-")], findings
