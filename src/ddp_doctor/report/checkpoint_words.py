"""The words of the checkpoint findings (`checkpoint-same-path`, `checkpoint-module-prefix`), from their evidence:
the file as shown, the line of the save, when it came, the writers' machines and the guard that let them through
(`ddp_doctor.report.words`)."""

from __future__ import annotations

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.report.wording import flag, measure, words

__all__: list[str] = []

_RACE = (
    "the writes race, and the file may end up torn, or written by whichever rank finished last, while another rank "
    "(or the next run) reads it"
)


def _when(f: Finding) -> str:
    """When the first save came: `steps` holds the last step closed before it; label `followed` for a save after
    the observed steps."""
    if flag(f, "followed"):
        return "after the observed steps, at an epoch end the check followed"
    return f"first after step {f.steps[0]}" if f.steps else "before the first step"


@words(Code.CHECKPOINT_SAME_PATH)
def _same_path(f: Finding) -> tuple[str, str]:
    """`ranks` and `more_ranks`: the writers; labels `file`, `site`, `followed`, `guard` (``local-rank``),
    `every_rank`, `hosts` (the writers' machines shown, comma-separated); measured `machines`, `writers_shown`
    (the writers whose saves the exchange quoted) and `more_files` (other files written likewise)."""
    count = len(f.ranks) + f.more_ranks
    shown = int(measure(f, "writers_shown") or count)
    hosts = f.labels["hosts"].split(",") if f.labels.get("hosts") else []
    more_files = int(measure(f, "more_files") or 0)
    file, site = f.labels["file"], f.labels.get("site") or "an unknown place"
    others = f" ({more_files} more file(s) likewise)" if more_files else ""
    if f.labels.get("guard") == "local-rank":
        guard = (
            f" {'Each of them' if shown == count else 'Each of the first ' + str(shown)} is local rank 0 of its node "
            "(torchrun's LOCAL_RANK): a guard on the local rank (`if local_rank == 0`) lets one rank per node "
            "through, not one per job."
        )
    elif flag(f, "every_rank"):
        guard = " Every rank wrote it: no rank guard kept the others from it."
    else:
        guard = " A rank guard let several ranks through, not one."
    if len(hosts) > 1:
        where = (
            f" They run on {'at least ' if shown < count else ''}{len(hosts)} machines ({', '.join(hosts)}), so the "
            "path is one file only where it is on a filesystem the machines share (NFS, Lustre, a mounted bucket): "
            f"there {_RACE}; on each machine's local disk, each keeps a copy of its own."
        )
    else:
        where = f" On one machine, {_RACE}."
    title = f"{count} ranks wrote the same {'path' if len(hosts) > 1 else 'file'} {file} with torch.save"
    detail = (
        f"{rank_list(f.ranks, more=f.more_ranks).capitalize()} each called torch.save on {file} at {site} "
        f"({_when(f)}){others}.{guard}{where} Under DDP the replicas are equal, so one write is enough."
    )
    return title, detail


@words(Code.CHECKPOINT_MODULE_PREFIX)
def _module_prefix(f: Finding) -> tuple[str, str]:
    """Labels `file` (the file as shown) and `site` (the save's line)."""
    title = f"the DDP wrapper's state dict was saved to {f.labels['file']} (keys start with 'module.')"
    detail = (
        f"torch.save at {f.labels.get('site') or 'an unknown place'} saved a state dict whose keys start with "
        "'module.': the DDP wrapper's, not the model's. Loading it into the model without DDP (for inference, or a "
        "run with another world size) fails with unexpected and missing keys."
    )
    return title, detail
