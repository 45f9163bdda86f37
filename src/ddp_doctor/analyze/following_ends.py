"""What following the script through its epoch ends found: a `collective-mismatch` after the observed steps (the `uneven-inputs` and repeated sampler epochs it counted are `epochs.py`'s),
the report's `following` section (the loaders, the epoch ends reached) and what went unchecked (a capped pass of a
loader without `len()`, `--follow-epochs 0`). Pure: reads the `FollowSummary` every rank agrees on.
"""

from __future__ import annotations

from ddp_doctor.analyze.collective_order import followed_apart
from ddp_doctor.analyze.epochs import counted_uneven, followed_epoch_repeated, lengths_uneven, loader_name
from ddp_doctor.analyze.timeouts import followed_timeout_risk
from ddp_doctor.core.findings import Finding, Unchecked
from ddp_doctor.core.following import Following, FollowSummary, JoinedLoop

__all__ = ["following_findings", "following_section", "unchecked"]

NO_LOADER = (
    "No epoch end was reached: the observed steps did not train on a DataLoader pass (a step-based loop, like "
    "nanoGPT's), so the check stopped after them."
)


def following_section(summary: FollowSummary | None, *, epochs: int, limit: int) -> Following | None:
    """The report's `following` section; None when the run ended before its observed steps did (nothing was
    followed, nothing to say)."""
    if summary is None or not (summary.followed or summary.declined):
        return None
    if not summary.followed:
        return Following(
            epochs=epochs,
            limit_batches=limit,
            epoch_ends=0,
            ended_by="",
            seconds=0.0,
            loaders=summary.loaders,
            note=NO_LOADER,
        )
    note = ""
    if summary.epoch_ends < epochs:
        note = (
            f"The script ended after {summary.epoch_ends} of the {epochs} epoch end(s) asked for."
            if summary.epoch_ends
            else "No epoch end was reached before the script ended."
        )
    return Following(
        epochs=epochs,
        limit_batches=limit,
        epoch_ends=summary.epoch_ends,
        ended_by=summary.ended_by,
        seconds=summary.seconds,
        loaders=summary.loaders,
        note=note,
    )


def following_findings(
    summary: FollowSummary | None,
    *,
    framework: str = "torch",
    lengths_compared: bool = False,
    parallelism: str = "ddp",
    world: int = 0,
    joined: JoinedLoop | None = None,
) -> list[Finding]:
    """The findings of following (`joined`: the Join over its DDP model the loop runs in). `uneven-inputs` from the counted passes comes whether or not anything was
    followed (the observed steps may have run a pass to its end); `lengths_compared`: the observed steps already
    reported the training loader's different `len()` per rank (not said twice). Without DDP (`parallelism`), the
    observed steps compared no loader: the training loaders' `len()` per rank and their samplers' epochs are
    compared here (over `world` ranks)."""
    if summary is None:
        return []
    own: list[Finding] = []
    if parallelism != "ddp":
        own = lengths_uneven(summary.loaders, parallelism, world)
        lengths_compared = bool(own)
        if summary.repeated_epoch is not None:
            own.append(followed_epoch_repeated(summary.repeated_epoch))
    uneven = [*own, *counted_uneven(summary.loaders, lengths_compared=lengths_compared, joined=joined)]
    if not summary.followed:
        return uneven
    return [*uneven, *followed_apart(summary), *followed_timeout_risk(summary, framework)]


def unchecked(
    summary: FollowSummary | None, *, epochs: int | None, limit: int, steps: int, watched: bool = False
) -> list[Unchecked]:
    """What the check did not run or could not see: the epoch end with `--follow-epochs 0` (`watched`:
    the rest of the job; `epochs` None: the script was not stopped after its observed steps, it ended or failed
    before them), and the loaders without len() whose passes the check capped."""
    out = []
    if watched:
        out.append(
            Unchecked(
                "later-steps",
                f"After its {steps} observed step(s) the job trained on under watch, which from then on looks for hangs "
                "and failures, and compares only the parameters of the DDP models across this node's ranks every few "
                "steps: the gradients, buffers, inputs, optimizer settings and the epoch ends (evaluation, checkpoint "
                "saves, the collectives there) of the later steps were not compared.",
                {"steps": steps, "after": "watch"},
            )
        )
    elif epochs == 0:  # (None: nothing came after the observed steps)
        out.append(
            Unchecked(
                "epoch-end",
                f"--follow-epochs 0: the script was stopped right after its {steps} observed step(s); its epoch end "
                "(evaluation, checkpoint saves, the collectives there) and every later epoch went unchecked, and a "
                "DataLoader pass still open then was never counted to its end. Leave --follow-epochs at 1 (the "
                "default) to follow one epoch end.",
                {"steps": steps, "follow_epochs": 0},
            )
        )
    for d in summary.loaders if summary is not None else []:
        c = d.get("counted") or {}
        if not d.get("no_len") or not d["capped"] or c.get("uneven"):
            continue
        name = f"The DataLoader {loader_name(d)}"
        if c.get("all_first_counted"):
            each = f" ({c['min']} each)" if c.get("min") == c.get("max") else ""
            out.append(
                Unchecked(
                    "loader-later-passes",
                    f"{name} has no len(): its batches were counted on every rank in its first pass{each}, but a later "
                    f"pass was capped by the check (at {limit} batch(es), or where the observed steps ended), so a "
                    "difference between the ranks' counts in later epochs (shards that change per epoch, say) would not "
                    "show.",
                    {"loader": loader_name(d), "cap": limit},
                )
            )
        else:
            out.append(
                Unchecked(
                    "loader-passes",
                    f"{name} has no len(), and the check ended its passes before they ran to their end on every rank "
                    f"(after the observed steps, then at {limit} batch(es)): its batches per rank were never counted, so "
                    "ranks with different numbers of batches per epoch would not show. Raise --steps above its batches "
                    "per epoch to count a whole pass.",
                    {"loader": loader_name(d), "cap": limit},
                )
            )
    return out
