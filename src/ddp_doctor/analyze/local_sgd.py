"""Post-local SGD: gradients and replicas that differ across ranks by design, from the step PyTorch's
`post_localSGD_hook` stops all-reducing over every rank, until a model averager averages the parameters. What was
seen (`observation/model_averaging.py`), and the words `replica-divergence` (replica_state.py) uses for it instead
of calling the algorithm a bug (`grads-not-synced`'s are the report's, `report/words.py`).

Ground truth (tests/scripts/local_sgd.py, plain torchrun, torch 2.13.0, gloo, 2 ranks, `start_localSGD_iter=3`,
subgroups of one rank, `PeriodicModelAverager(period=4, warmup_steps=3)`): exit 0; the gradients agree at steps 0-2
and differ from step 3 on; the replicas part after each optimizer step from step 3 and are equal again after each
averaging (the parameters' sums agree on both ranks at the end, after the averaging of step 15). Without the
averager the replicas stay apart to the end (the sums differ by 0.028 after 16 steps).
"""

from __future__ import annotations

from ddp_doctor.analyze.view import View
from ddp_doctor.core.agreed import LocalAveraging

__all__ = ["local_sgd", "weights_words"]


def weights_words(local: LocalAveraging) -> tuple[str, str, str, str]:
    """`replica-divergence`'s severity, title, detail and fix under `local`: info when a model averager ran in
    the steps observed since local SGD began, a warning when none did."""
    since = local.steps - local.first_step
    if local.averaged_after:
        over = f"{local.averaged_over} of {local.world} ranks" if local.averaged_over != local.world else "every rank"
        where = f" ({local.averager_site})" if local.averager_site else ""
        return (
            "info",
            f"post-local SGD: the replicas part between model averagings (averaged after {_steps(local.averaged_after)})",
            f"From step {local.first_step} each replica steps on its own gradients, and a model averager{where} "
            f"averaged the parameters over {over} after {_steps(local.averaged_after)}. The weights are "
            "compared after each optimizer step, before an averaging: that the replicas agree right after one "
            "was not compared.",
            "",
        )
    return (
        "warning",
        f"post-local SGD: the replicas part from step {local.first_step} and no model averaging was seen",
        f"From step {local.first_step} each replica steps on its own gradients (post_localSGD_hook), and no model "
        f"averager averaged the parameters in the {since} observed step{'s' if since != 1 else ''} since: "
        "without one the replicas never meet again. If the averager's period is longer than that, this is "
        "expected.",
        "average the parameters after optimizer.step() every few steps: `averager = torch.distributed.algorithms."
        "model_averaging.averagers.PeriodicModelAverager(period=4, warmup_steps=start_localSGD_iter)` and "
        "`averager.average_parameters(model.parameters())` after each step (or wrap the optimizer in "
        "torch.distributed.optim.PostLocalSGDOptimizer).",
    )


def local_sgd(v: View) -> LocalAveraging | None:
    """Post-local SGD that began within or before the observed steps, with gradients averaged over fewer ranks
    than the group; None otherwise (any difference in gradients or weights is then a fault)."""
    state = (v.meta(0).get("comm_hook") or {}).get("local_sgd")
    if not state or not state.get("began"):
        return None
    averaging = v.meta(0).get("model_averaging") or {}
    return LocalAveraging(
        first_step=max(0, state["from_iteration"] - state.get("observed_from", 0)),
        from_iteration=state["from_iteration"],
        subgroup=state.get("subgroup_size"),
        averaged_after=list(averaging.get("after_steps") or []),
        averaged_over=averaging.get("group_size"),
        averager_site=averaging.get("site"),
        world=v.world,
        steps=v.steps,
    )


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
