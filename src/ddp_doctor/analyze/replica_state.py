"""What every rank's copy of the job holds beside its weights, one rule for every parallelism: the optimizer's
settings (`optimizer-differs`) and the modules' train/eval modes (`replica-divergence`). DDP's road (`causes.py`,
`tree_state.py`) and the sharded one (`sharded_findings`) hand in what the ranks held at the first step where they
differed; the parallelism changes the consequence the finding states, not the rule.

Ground truth for the sharded road, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps
(`tests/scripts/fsdp2_train.py`):
- `--mistake sched-rank0` (a StepLR with gamma 0.5 stepped on rank 0 alone from the third step): exit 0, nothing
  said; the last learning rate is 9.77e-06 on rank 0 and 0.01 on rank 1, and the gathered head.weight sums to
  -0.952121 (-1.060282 with the scheduler stepped on every rank): each rank stepped its own shard of every
  parameter at its own rate.
- `--mistake train-rank0` (a Dropout in the first block; an evaluation in eval mode on every rank after the third
  step, then `model.train()` on rank 0 alone): exit 0, nothing said; rank 1 trains on in eval mode (dropout off),
  head.weight sums to -1.407930 (-1.468885 with every rank back in train mode).
"""

from __future__ import annotations

import re
from typing import Any

from ddp_doctor.analyze.common import with_more
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, lines_of
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = ["modes_finding", "settings_finding", "sharded_replica_state"]

_FIELD = re.compile(r"(\w+)=([^,;]+)")

_SETTINGS_APART = {
    "ddp": "Identical gradients then give different updates, so the replicas drift apart.",
    "replicate": "Identical gradients then give different updates, so the replicas drift apart.",
    "fsdp2": "Each rank steps its own shard of every parameter, so the shards of one parameter were updated with "
    "different settings: no one setting trains this model.",
}
_MODES_APART = {
    "ddp": "so their gradients and buffers part although DDP syncs every gradient.",
    "replicate": "so their gradients and buffers part although replicate syncs every gradient.",
    "fsdp2": "so the gradients FSDP2 averages come from different computations, and buffers such as BatchNorm's "
    "running statistics part.",
}


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


def settings_finding(
    *,
    step: int,
    held: dict[int, str],
    reference: int,
    ranks: list[int],
    parallelism: str,
    where: str = "",
    fix: str = "set every optimizer hyperparameter identically on every rank.",
    sites: tuple[str, ...] = (),
) -> Finding:
    """`optimizer-differs` at `step`: `held` maps ranks to their optimizer's settings (`optimizers.describe`'s
    text), `reference` first; `ranks` are the ranks the finding names."""
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
        f"{key}: " + ", ".join(f"{value} on rank {r}" for r, value in by_rank.items())
        for key, by_rank in ((k, values[k]) for k in fields[:4])
    )
    names = ", ".join(k.split(" ", 2)[-1] for k in fields[:4]) or "settings"
    return Finding(
        code=Code.OPTIMIZER_DIFFERS,
        sites=lines_of(*sites),
        severity="error",
        title=f"the optimizer's {names} {'differs' if len(fields) == 1 else 'differ'} across ranks from step {step}",
        detail=f"At optimizer step {step}, which every rank took, the optimizers' settings were not the same "
        f"({said or 'the groups differ'}). {_SETTINGS_APART[parallelism]}{where}",
        params=[],
        ranks=ranks,
        steps=[step],
        fix=fix,
    )


def modes_finding(
    *, step: int, held: dict[int, dict[str, Any]], reference: int, ranks: list[int], parallelism: str
) -> Finding:
    """`replica-divergence` (a warning) at `step`: `held` maps ranks to their modes entry (`training`,
    `other_mode`, `other_mode_count`), `reference` first."""
    said = []
    for r, entry in list(held.items())[:4]:
        mode = "train" if entry.get("training") else "eval"
        other = entry.get("other_mode") or []
        more = entry.get("other_mode_count", 0) - len(other)
        except_ = (
            f" except {', '.join(o or '(the model)' for o in other)}{f' (+{more} more)' if more > 0 else ''} "
            f"({'eval' if mode == 'train' else 'train'})"
            if other
            else ""
        )
        said.append(f"rank {r}: the model in {mode} mode{except_}")
    return Finding(
        code=Code.REPLICA_DIVERGENCE,
        severity="warning",
        title=f"modules are in train mode on some ranks and in eval mode on others at step {step}",
        detail=f"When optimizer step {step} ended, the ranks' models were not in the same mode ({'; '.join(said)}"
        f"). Dropout, BatchNorm and any code that reads `self.training` then compute differently on the ranks, "
        f"{_MODES_APART[parallelism]} Rank {reference}'s model was in "
        f"{'train' if held.get(reference, {}).get('training') else 'eval'} mode.",
        params=[],
        ranks=ranks,
        steps=[step],
        fix="set the mode on every rank alike: after an evaluation that calls `model.eval()` on some ranks, call "
        "`model.train()` on the same ranks before training resumes (or evaluate on every rank).",
    )


def sharded_replica_state(run: ShardedRun) -> list[Finding]:
    """The optimizer's settings and the modules' modes of an FSDP2 or `replicate` job, compared across ranks at the
    first `INPUT_STEPS` observed steps (`ShardedRun.settings_apart`, `modes_apart`)."""
    parallelism = parallelism_of(run.sharding)
    found = []
    if (apart := run.settings_apart) is not None:
        held = {int(r): v for r, v in apart["held"].items()}
        finding = settings_finding(
            step=apart["step"],
            held=held,
            reference=apart["reference"],
            ranks=sorted({apart["reference"], *apart["ranks"]}),
            parallelism=parallelism,
            fix="set every optimizer hyperparameter identically on every rank (an LR scheduler stepped on some "
            "ranks only does this: step it on every rank).",
        )
        found.append(with_more(finding, apart["more"]))
    if (apart := run.modes_apart) is not None:
        finding = modes_finding(
            step=apart["step"],
            held={int(r): v for r, v in apart["held"].items()},
            reference=apart["reference"],
            ranks=sorted({apart["reference"], *apart["ranks"]}),
            parallelism=parallelism,
        )
        found.append(with_more(finding, apart["more"]))
    return found
