"""Checkpoint findings: `checkpoint-same-path` (several ranks wrote one file with torch.save) and
`checkpoint-module-prefix` (the DDP wrapper's state dict was saved). Pure: reads the exchange's summary."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, lines_of
from ddp_doctor.core.ranks import rank_list

__all__ = ["checkpoint_module_prefix", "checkpoint_same_path"]


def _steps(save: dict[str, Any]) -> list[int]:
    """The last step closed before the save (none when it came before the first, or after the observed steps)."""
    if save.get("followed"):
        return []
    step = int(save.get("step", -1))
    return [step] if step >= 0 else []


def _when(save: dict[str, Any]) -> str:
    if save.get("followed"):
        return "after the observed steps, at an epoch end the check followed"
    step = int(save.get("step", -1))
    return f"first after step {step}" if step >= 0 else "before the first step"


@detects(Code.CHECKPOINT_SAME_PATH)
def checkpoint_same_path(v: View) -> list[Finding]:
    """Several ranks wrote the same file with `torch.save` while observed: no rank guard around the save."""
    who = v.ranks("same-path-save")
    if v.world < 2 or who.count < 2 or not who.ranks:
        return []
    saves = v.meta(who.ranks[0]).get("shared_saves", [])
    if not saves:
        return []
    first = saves[0]
    others = f" ({len(saves) - 1} more file(s) likewise)" if len(saves) > 1 else ""
    site = first.get("site") or "an unknown place"
    return [
        with_more(
            Finding(
                code=Code.CHECKPOINT_SAME_PATH,
                severity="warning",
                title=f"{who.count} ranks wrote the same file {first['shown']} with torch.save",
                detail=f"{rank_list(who.ranks, more=who.more).capitalize()} each called torch.save "
                f"on {first['shown']} at {site} ({_when(first)}){others}. With no rank guard "
                "every rank writes the same file at once: the writes race, and the file may end up torn, or written "
                "by whichever rank finished last, while another rank (or the next run) reads it. Under DDP the "
                "replicas are equal, so one write is enough.",
                ranks=who.ranks,
                steps=_steps(first),
                sites=lines_of(first.get("site") or ""),
                fix="write on one rank, then a barrier: `if dist.get_rank() == 0: torch.save(...)`, then "
                "`dist.barrier()` on every rank before anyone reads the file (Accelerate: `accelerator.save(...)`; "
                "the HF Trainer and Lightning already save on one rank).",
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
            title=f"the DDP wrapper's state dict was saved to {first['shown']} (keys start with 'module.')",
            detail=f"torch.save at {first.get('site') or 'an unknown place'} saved a state dict whose keys start "
            "with 'module.': the DDP wrapper's, not the model's. Loading it into the model without DDP (for "
            "inference, or a run with another world size) fails with unexpected and missing keys.",
            ranks=[0],
            steps=_steps(first),
            sites=lines_of(first.get("site") or ""),
            fix="save model.module.state_dict() instead, or strip the prefix when loading "
            "(torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')).",
        )
    ]
