"""`guard` under post-local SGD (torch's `post_localSGD_hook`, subgroups of one rank from iteration 3, a
`PeriodicModelAverager(period=4, warmup_steps=3)` after each optimizer step; ground truth under plain torchrun in
tests/sync/test_check_local_sgd.py): the replicas differ after every optimizer step by design and are equal right
after each model averaging, so a due comparison waits for the next averaging. Before, `guard(every=4,
on_problem="raise")` raised `replica-divergence` at its first comparison past iteration 3 on a healthy job.

partial: the averager is given the first layer's parameters only; the last layer's stay apart for good (plain
torchrun: its weights differ on the two ranks at the end, the first layer's agree), which the comparison after an
averaging names."""

from __future__ import annotations

import torch
from dist import run_ranks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import guard


def _local_sgd(rank: int, world: int, case: str) -> tuple[list[tuple], list[bool]]:
    import torch.distributed as dist

    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)))
    subgroup, _ = dist.new_subgroups(group_size=1)
    ddp.register_comm_hook(PostLocalSGDState(None, subgroup, start_localSGD_iter=3), post_localSGD_hook)
    averager = PeriodicModelAverager(period=4, warmup_steps=3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = guard(ddp, every=4, on_problem="warn", optimizer=opt)
    averaged = ddp.module[0] if case == "partial" else ddp  # the module whose parameters the averager gets
    for step in range(24):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
        averager.average_parameters(averaged.parameters())
    sums = [float(p.sum()) for p in ddp.parameters()]
    out = [None] * world
    dist.all_gather_object(out, sums)
    same = [all(s[i] == out[0][i] for s in out) for i in range(len(sums))]
    return [(f.code, f.param_names, f.steps) for f in g.problems], same


def test_a_guarded_post_local_sgd_job_is_compared_after_its_model_averagings(tmp_path) -> None:
    for problems, same in run_ranks(_local_sgd, tmp_path, args=("averaged",)):
        assert problems == [] and all(same), (problems, same)


def test_parameters_the_averager_leaves_out_are_named_after_an_averaging(tmp_path) -> None:
    for problems, same in run_ranks(_local_sgd, tmp_path, args=("partial",)):
        assert same == [True, True, False, False], same  # the ground truth: the last layer never meets again
        assert problems and problems[0][0] == "replica-divergence", problems
        assert problems[0][1] == ["2.weight", "2.bias"], problems
