"""Scenario runners beyond the one-model matrix: a model with no DDP at all, and two observed DDP models (a GAN)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from scenarios import Case, Net, batch, device, loss_both, run_applied
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import DDPFailure, observe


def run_unwrapped(rank: int, world: int, sync: str | None) -> dict[str, Any]:
    """A model trained on every rank with no DDP around it (the watch `ddp-doctor check` uses when a script builds
    no DDP), with no sync or a correct manual one; then the fix (DDP) applied with the reference check."""
    import ddp_doctor
    from ddp_doctor.doctor.plain_watch import PlainOptimizerWatch

    torch.manual_seed(0)
    net = Net().to(device())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    watch = PlainOptimizerWatch()
    handle = opt.register_step_post_hook(lambda o, _args, _kwargs: watch.on_step(o))
    for step in range(4):
        loss_both(net, net, batch(rank, step), step, rank).backward()
        if sync == "sync_gradients":
            ddp_doctor.sync_gradients(net)
        opt.step()
        opt.zero_grad()
    handle.remove()
    report = watch.report()
    fix = {
        "find_unused_parameters": False,
        "static_graph": False,
        "gradient_as_bucket_view": False,
        "freeze_before_wrap": [],
    }
    return {
        "report": report.to_dict(),
        "text": str(report),
        "applied": run_applied(Case(name="wrapped", codes=set()), rank, fix),
    }


def run_two_models(rank: int, world: int) -> dict[str, Any]:
    """A GAN-shaped loop: a critic whose head_b never reaches the loss (default flags: DDP fails at step 1) and a
    generator that is fine, each with its own optimizer and its own observe(). Each report must be about its own
    model only."""
    torch.manual_seed(0)
    gen, critic = DDP(Net()), DDP(Net())
    g_opt, c_opt = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(critic.parameters(), lr=0.1)
    watch_g, watch_c = observe(gen, optimizer=g_opt), observe(critic, optimizer=c_opt)
    raised = None
    try:
        with watch_g, watch_c:
            for step in range(3):
                x, y = batch(rank, step)
                F.mse_loss(critic(x), y).backward()  # the critic's head_b never runs
                c_opt.step()
                c_opt.zero_grad()
                F.mse_loss(gen(x, use_b=True), y).backward()
                g_opt.step()
                g_opt.zero_grad()
    except DDPFailure as exc:
        raised = exc.code
    gen_report, critic_report = watch_g.report(timeout=20), watch_c.report(timeout=20)
    return {
        "raised": raised,
        "generator": gen_report.to_dict(),
        "critic": critic_report.to_dict(),
        "text": str(critic_report),
    }
