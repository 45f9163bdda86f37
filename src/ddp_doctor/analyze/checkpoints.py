"""Checkpoint findings: `checkpoint-same-path` (several ranks wrote one file with torch.save) and
`checkpoint-module-prefix` (the DDP wrapper's state dict was saved). Pure: reads the exchange's summary."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of

__all__ = ["checkpoint_module_prefix", "checkpoint_same_path"]


def _steps(save: dict[str, Any]) -> list[int]:
    """The last step closed before the save (none when it came before the first, or after the observed steps)."""
    if save.get("followed"):
        return []
    step = int(save.get("step", -1))
    return [step] if step >= 0 else []


@detects(Code.CHECKPOINT_SAME_PATH)
def checkpoint_same_path(v: View) -> list[Finding]:
    """Several ranks wrote the same path with `torch.save` while observed: no rank guard around the save, or one
    that lets several ranks through (a guard on the local rank lets one per node through).

    Ground truth (tests/lockstep/test_checkpoints.py, pytorch/examples' minGPT-ddp loop, which saves its snapshot
    under `if self.local_rank == 0`): two torchrun nodes of one rank each on one machine, plain torchrun: both ranks
    write snapshot.pt at every epoch end, exit 0, nothing said. On machines of their own the path names one file
    only where it is on a filesystem they share."""
    who = v.ranks("same-path-save")
    if v.world < 2 or who.count < 2 or not who.ranks:
        return []
    saves = v.meta(who.ranks[0]).get("shared_saves", [])
    if not saves:
        return []
    first = saves[0]
    # The first few writers' saves (`exchange/strings.SAVERS_QUOTED`): their machines and local ranks.
    writers = [
        next((d for d in v.summary.metas[r].get("shared_saves", []) if d["path"] == first["path"]), {})
        for r in who.ranks
        if r in v.summary.metas
    ]
    hosts = sorted({d["host"] for d in writers if d.get("host")})
    local_guard = all(d.get("local_rank") == 0 for d in writers)
    labels = {"file": str(first["shown"]), "site": first.get("site") or ""}
    if first.get("followed"):
        labels["followed"] = "True"
    if local_guard:
        labels["guard"] = "local-rank"
    if who.count == v.world:
        labels["every_rank"] = "True"
    if hosts:
        labels["hosts"] = ",".join(hosts)
    measured = [Measure("machines", len(hosts), "count")] if hosts else []
    measured += [Measure("writers_shown", len(writers), "count"), Measure("more_files", len(saves) - 1, "count")]
    fix = (
        "write on one rank, then a barrier: `if dist.get_rank() == 0: torch.save(...)`, then `dist.barrier()` on "
        "every rank before anyone reads the file (Accelerate: `accelerator.save(...)`; the HF Trainer and Lightning "
        "already save on one rank)."
    )
    if local_guard:
        fix = "guard the save with the global rank, not the local one: " + fix
    return [
        with_more(
            Finding(
                code=Code.CHECKPOINT_SAME_PATH,
                severity="warning",
                ranks=who.ranks,
                steps=_steps(first),
                sites=lines_of(first.get("site") or ""),
                measured=measured,
                labels=labels,
                fix=fix,
            ),
            who.more,
        )
    ]


@detects(Code.CHECKPOINT_MODULE_PREFIX)
def checkpoint_module_prefix(v: View) -> list[Finding]:
    """Rank 0 saved a state dict of the DDP wrapper (keys `module.*`): loading it into the bare model fails."""
    saves = v.meta(0).get("module_saves", []) if 0 in v.summary.metas else []
    if not saves:
        return []
    first = saves[0]
    return [
        Finding(
            code=Code.CHECKPOINT_MODULE_PREFIX,
            severity="info",
            labels={"file": str(first["shown"]), "site": first.get("site") or ""},
            ranks=[0],
            steps=_steps(first),
            sites=lines_of(first.get("site") or ""),
            fix="save model.module.state_dict() instead, or strip the prefix when loading "
            "(torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')).",
        )
    ]
