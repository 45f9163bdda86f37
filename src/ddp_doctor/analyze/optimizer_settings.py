"""The optimizers' settings compared across ranks (`optimizer-differs`), one detector for every parallelism
(`optimizer_differs`, of the `Agreed` facts): DDP's exchange hands in the settings of rank 0 and the ranks that
differ from it, a sharded model's the settings of the rank holding the most common ones and of the first other
rank. The parallelism changes the consequence the finding states, not the rule."""

from __future__ import annotations

import re

from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.view import detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, calls_of, lines_of
from ddp_doctor.core.ranks import rank_list

__all__ = ["metric_scheduler_words", "optimizer_differs", "settings_apart"]

_SAME_SETTINGS_SHARDED = (
    "set every optimizer hyperparameter identically on every rank (an LR scheduler stepped on some ranks only "
    "does this: step it on every rank)."
)
_FIELD = re.compile(r"(\w+)=([^,;]+)")
_PLATEAU = "ReduceLROnPlateau.step()"
"""The call of a scheduler that reads a metric, as `calls_of` names a scheduler's call."""

_SETTINGS_APART = {
    "ddp": "Identical gradients then give different updates, so the replicas drift apart.",
    "replicate": "Identical gradients then give different updates, so the replicas drift apart.",
    "fsdp2": "Each rank steps its own shard of every parameter, so the shards of one parameter were updated with "
    "different settings: no one setting trains this model.",
}


_LABELS = {
    "state size": "tensors with optimizer state",
    "state step": "the first one's step count",
    "state loaded": "state loaded by load_state_dict at",
}
"""The fields of the optimizer's state (`optimizers.describe`), in words."""
_SAME_SETTINGS = "set every optimizer hyperparameter identically on every rank."
_SAME_STATE = (
    "load the optimizer's state on every rank alike: every rank reads the checkpoint (torch.load with map_location) "
    "and calls optimizer.load_state_dict, or none does; DDP's constructor broadcasts the model's weights, never the "
    "optimizer's state."
)


def _settings(text: str) -> dict[str, str]:
    """`group 0 (4 tensors) lr=0.1, momentum=0.9; group 1 ...` -> {"group 0 lr": "0.1", ...}."""
    out = {}
    for part in text.split("; "):
        head = part.split(" (", 1)[0]
        count = re.search(r"\((\d+) tensors\)", part)
        if count:
            out[f"{head} size"] = count.group(1)
        for key, value in _FIELD.findall(part.split(") ", 1)[-1]):
            out[f"{head} {key}"] = value.strip()
    return out


def settings_apart(
    *,
    step: int,
    held: dict[int, str],
    reference: int,
    ranks: list[int],
    parallelism: str,
    where: str = "",
    fix: str = _SAME_SETTINGS,
    sites: tuple[str, ...] = (),
    call: str | None = None,
) -> Finding:
    """`optimizer-differs` at `step`, for every parallelism (the consequence it states is `parallelism`'s): `held` maps ranks to their optimizer's settings (`optimizers.describe`'s
    text), `reference` first; `ranks` are the ranks the finding names; `call` the call that set them apart (an LR
    scheduler's `StepLR.step()`), where one is known."""
    ref = _settings(held.get(reference, ""))
    values: dict[str, dict[int, str]] = {}
    for r, text in held.items():
        if r == reference:
            continue
        other = _settings(text)
        for key in sorted(set(ref) | set(other)):
            if ref.get(key) != other.get(key):
                values.setdefault(key, {reference: ref.get(key, "absent")})[r] = other.get(key, "absent")
    fields = [k for k in values if not k.endswith("initial_lr")] or list(values)
    said = "; ".join(
        f"{_LABELS.get(key, key)}: " + ", ".join(f"{value} on rank {r}" for r, value in by_rank.items())
        for key, by_rank in ((k, values[k]) for k in fields[:4])
    )
    names = list(dict.fromkeys("state" if k in _LABELS else k.split(" ", 2)[-1] for k in fields[:4]))
    state_only = bool(fields) and all(k in _LABELS for k in fields)
    if state_only and fix == _SAME_SETTINGS:
        fix = _SAME_STATE
    loaded = [v for v in values.get("state loaded", {}).values() if v != "absent"]
    measured = [
        Measure(f"{key} (rank {r})", float(value), "value")
        for key in fields[:4]
        for r, value in values[key].items()
        if _number(value)
    ]
    return Finding(
        code=Code.OPTIMIZER_DIFFERS,
        sites=lines_of(*sites, *loaded),
        severity="error",
        title=f"the optimizer's {', '.join(names) or 'settings'} {'differs' if len(names) == 1 else 'differ'} "
        f"across ranks from step {step}",
        detail=f"At optimizer step {step}, which every rank took, the optimizers' "
        f"{'state was' if state_only else 'settings were'} not the same "
        f"({said or 'the groups differ'}). {_SETTINGS_APART[parallelism]}{where}",
        params=[],
        ranks=ranks,
        steps=[step],
        measured=measured,
        fix=fix,
        labels={"call": call} if call else {},
    )


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def metric_scheduler_words(sites: list[str]) -> tuple[str, str]:
    """The cause and fix of settings that part under a scheduler stepped alike on every rank that reads a metric
    (ReduceLROnPlateau at `sites`): each rank's own value (its loss) cuts the rate at its own step. Ground truth
    (tests/scripts/cause_plateau_local.py, plain torchrun, 2 ranks, 16 steps): rates 0.0016 and 0.00078, the weights
    0.010 apart; with the loss all-reduced first, equal."""
    where = (
        f" A scheduler that reads a metric (ReduceLROnPlateau, stepped at {', '.join(sites)}) sets the learning rate "
        "from the value each rank passes it: a rank's own value (its own loss) cuts the rate on some ranks first."
    )
    fix = (
        f"pass the scheduler at {sites[0]} a metric reduced across the ranks (dist.all_reduce(metric); "
        "metric /= world_size) so every rank cuts the rate at the same step."
    )
    return where, fix


@detects(Code.OPTIMIZER_DIFFERS, road="every")
def optimizer_differs(a: Agreed) -> list[Finding]:
    """At a step that every rank took, the optimizers' settings differ: a hyperparameter, the groups, or what an
    LR scheduler stepped on some ranks only set, whatever the parallelism (`settings_apart` words its
    consequence for it).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py
    --mistake sched-rank0`, a StepLR with gamma 0.5 stepped on rank 0 alone from the third step): exit 0, nothing
    said; the last learning rate is 9.77e-06 on rank 0 and 0.01 on rank 1, and the gathered head.weight sums to
    -0.952121 (-1.060282 with the scheduler stepped on every rank): each rank stepped its own shard of every
    parameter at its own rate. DDP: tests/causes/test_causes.py."""
    apart = a.settings_apart
    if a.world < 2 or apart is None:
        return []
    # Where a sharded model's exchange does not count the scheduler's steps, the fix names that cause too.
    where, fix, sites, call = "", _SAME_SETTINGS if a.schedulers_counted else _SAME_SETTINGS_SHARDED, [], None
    if (stepped := a.scheduler_apart) is not None:
        sites = stepped.sites
        where = (
            f" An LR scheduler was stepped on {rank_list(stepped.ranks, more=stepped.more)} only, in step "
            f"{stepped.step}"
            + (f" ({', '.join(sites)})" if sites else "")
            + ": the other ranks' learning rate stayed where it was."
        )
        fix = (
            "step the LR scheduler on every rank"
            + (
                f" (move the call at {sites[0].rsplit(' at ', 1)[-1]} out of its rank-dependent branch)"
                if sites
                else ""
            )
            + "; change any optimizer setting on every rank alike."
        )
        call = next(iter(calls_of(*sites)), None)
    elif a.metric_schedulers:
        sites, call = list(a.metric_schedulers), _PLATEAU
        where, fix = metric_scheduler_words(sites)
    finding = settings_apart(
        step=apart.step,
        held=apart.held,
        reference=apart.reference,
        ranks=apart.named,
        parallelism=a.parallelism,
        where=where,
        fix=fix,
        sites=tuple(sites),
        call=call,
    )
    return [with_more(finding, apart.more)]
