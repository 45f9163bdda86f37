"""Checkpoint findings: `checkpoint-same-path` (several ranks wrote one file with torch.save) and
`checkpoint-module-prefix` (the DDP wrapper's state dict was saved). Pure: reads the exchange's summary."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
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
    others = f" ({len(saves) - 1} more file(s) likewise)" if len(saves) > 1 else ""
    site = first.get("site") or "an unknown place"
    if local_guard:
        guard = (
            f" {'Each of them' if len(writers) == who.count else 'Each of the first ' + str(len(writers))} is local "
            "rank 0 of its node (torchrun's LOCAL_RANK): a guard on the local rank "
            "(`if local_rank == 0`) lets one rank per node through, not one per job."
        )
    elif who.count == v.world:
        guard = " Every rank wrote it: no rank guard kept the others from it."
    else:
        guard = " A rank guard let several ranks through, not one."
    race = (
        "the writes race, and the file may end up torn, or written by whichever rank finished last, while another "
        "rank (or the next run) reads it"
    )
    if len(hosts) > 1:
        where = (
            f" They run on {'at least ' if len(writers) < who.count else ''}{len(hosts)} machines "
            f"({', '.join(hosts)}), so the path is one file only where it is "
            f"on a filesystem the machines share (NFS, Lustre, a mounted bucket): there {race}; on each machine's "
            "local disk, each keeps a copy of its own."
        )
    else:
        where = f" On one machine, {race}."
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
                title=f"{who.count} ranks wrote the same {'path' if len(hosts) > 1 else 'file'} {first['shown']} "
                "with torch.save",
                detail=f"{rank_list(who.ranks, more=who.more).capitalize()} each called torch.save on "
                f"{first['shown']} at {site} ({_when(first)}){others}.{guard}{where} Under DDP the replicas are "
                "equal, so one write is enough.",
                ranks=who.ranks,
                steps=_steps(first),
                sites=lines_of(first.get("site") or ""),
                measured=[Measure("machines", len(hosts), "count")] if hosts else [],
                labels={"guard": "local-rank"} if local_guard else {},
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
