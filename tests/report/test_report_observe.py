"""The in-process `observe` API: `doctor.report()` carries the figures' data and `report.to_html()` draws it, on
real 2-rank gloo groups."""

from __future__ import annotations

import torch.nn.functional as F
from dist import run_ranks
from scenarios import Net, batch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import observe


def _head_b_on_rank_0_only(rank: int, world: int) -> dict:
    import torch

    torch.manual_seed(0)
    ddp = DDP(Net(), find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with observe(ddp, optimizer=opt) as doctor:
        for step in range(3):
            x, y = batch(rank, step)
            F.mse_loss(ddp(x, use_b=rank == 0), y).backward()
            opt.step()
            opt.zero_grad()
    report = doctor.report()
    page = report.to_html()
    usage = report.usage_map
    return {
        "codes": sorted(report.codes),
        "ranks": [p.ranks for p in usage.patterns],
        "head_b": {
            tuple(p.ranks): dict(zip([r.name for r in usage.rows], p.cells))["head_b.weight"] for p in usage.patterns
        },
        "weights_start": report.divergence.weights_start,
        "figures": page.count("<figure"),
        "svgs": page.count("<svg"),
    }


def test_observe_report_draws_the_rank_dependent_head_on_every_rank(tmp_path) -> None:
    seen = run_ranks(_head_b_on_rank_0_only, tmp_path)
    assert seen[0] == seen[1]  # the same report, and the same page, on every rank
    got = seen[0]
    assert "rank-dependent-graph" in got["codes"]
    assert got["ranks"] == [[0], [1]] and got["head_b"] == {(0,): "UUU", (1,): "NNN"}
    assert got["weights_start"] is None  # find_unused_parameters=True kept them in sync
    assert got["figures"] == 3 and got["svgs"] == 3  # usage map, divergence curve, step time per rank
