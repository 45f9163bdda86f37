"""`checkpoint-same-path` and `checkpoint-module-prefix` on real gloo ranks: every rank saving one file is named with
the path, the ranks and the line; a rank-0 save behind a barrier, or one file per rank, says nothing; a save under
`if local_rank == 0` on two nodes names the guard, and on two machines says the path is one file only on a
filesystem they share."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from checkrun import SCRIPTS, finish, free_port, line_of, start
from dist import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor import observe


def _save(rank: int, world: int, folder: str, how: str, machines: int = 1) -> list[dict]:
    if machines > 1:  # each rank on a machine of its own: the name the save records
        socket.gethostname = lambda: f"node{rank}"
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
                    torch.save(ddp.state_dict(), f"{folder}/last.pt")  # the line the finding names
                elif how == "local-rank-0":  # each rank its node's only one (LOCAL_RANK=0 on every rank)
                    torch.save(ddp.module.state_dict(), f"{folder}/last.pt")
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
        line = line_of(__file__, "# the line the " + "finding names")
        assert f["sites"] == [f"tests/lockstep/test_checkpoints.py:{line}"] and f"{tmp_path}/last.pt" in f["title"], f
        assert f["labels"]["file"] == f"{tmp_path}/last.pt" and f["labels"]["every_rank"] == "True", f
        assert f["labels"]["site"].startswith(f["sites"][0]) and "guard" not in f["labels"], f
        assert {m["name"]: m["value"] for m in f["measured"]} == {"machines": 1, "writers_shown": 2, "more_files": 0}
        assert "dist.barrier()" in f["fix"] and "get_rank() == 0" in f["fix"], f
        prefix = [f for f in findings if f["code"] == "checkpoint-module-prefix"]
        assert len(prefix) == 1 and prefix[0]["severity"] == "info", findings
        assert "model.module.state_dict()" in prefix[0]["fix"], prefix


@pytest.mark.parametrize("how", ["rank0-then-barrier", "per-rank"])
def test_a_guarded_save_or_one_file_per_rank_says_nothing(how: str, tmp_path: Path) -> None:
    for findings in run_ranks(_save, tmp_path, args=(str(tmp_path), how)):
        assert not [f for f in findings if f["code"].startswith("checkpoint-")], findings


@pytest.mark.parametrize("machines", [1, 2])
def test_a_save_under_local_rank_0_on_two_nodes_names_the_guard_and_counts_the_machines(
    machines: int, tmp_path: Path
) -> None:
    """Every rank is its node's local rank 0 (two nodes of one rank each): the guard lets both through."""
    for findings in run_ranks(_save, tmp_path, args=(str(tmp_path), "local-rank-0", machines), env={"LOCAL_RANK": "0"}):
        (f,) = [f for f in findings if f["code"] == "checkpoint-same-path"]
        assert (f["ranks"], f["steps"], f["labels"]["guard"]) == ([0, 1], [1], "local-rank"), f
        assert len(f["labels"]["hosts"].split(",")) == machines, f
        assert {m["name"]: m["value"] for m in f["measured"]} == {
            "machines": machines,
            "writers_shown": 2,
            "more_files": 0,
        }
        assert f["fix"].startswith("guard the save with the global rank"), f  # which fix: no evidence field says


def test_the_check_of_two_torchrun_nodes_names_a_local_rank_0_snapshot(tmp_path: Path) -> None:
    """tests/scripts/local_rank_save.py on two torchrun nodes of one rank each, on one machine. Plain torchrun: both
    ranks (each local rank 0) write snapshot.pt at both epoch ends, exit 0, nothing said."""
    port = free_port()
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint"]
    rdzv += [f"127.0.0.1:{port}", "--rdzv-id", f"save-{port}", "--steps", "4", "--timeout", "90"]
    script = [str(SCRIPTS / "local_rank_save.py"), str(tmp_path)]
    started = time.monotonic()
    nodes = [start([*rdzv, "--node-rank", str(n), *script], tmp_path, name=f"node{n}.json") for n in (0, 1)]
    for run in [finish(proc, out, timeout=120, started=started) for proc, out in nodes]:
        same = run.finding("checkpoint-same-path")
        assert (same["ranks"], same["labels"]["guard"], same["sites"]) == (
            [0, 1],
            "local-rank",
            [f"tests/scripts/local_rank_save.py:{line_of(SCRIPTS / 'local_rank_save.py', 'torch.save(')}"],
        ), run.output
        assert {m["name"]: m["value"] for m in same["measured"]} == {"machines": 1, "writers_shown": 2, "more_files": 0}
