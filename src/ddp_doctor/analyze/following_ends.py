"""What following the script through its epoch ends found: `timeout-risk`, a `collective-mismatch` after the
observed steps, `uneven-inputs` from the batches each rank's passes handed out (counted, with or without `len()`),
the report's `following` section (the loaders, the epoch ends reached) and what went unchecked (a capped pass of a
loader without `len()`, `--follow-epochs 0`). Pure: reads the `FollowSummary` every rank agrees on.

`timeout-risk` rule: at one sync point (a collective every rank must enter), one rank arrived later than every
other by a span of its own work, and that span, with each capped DataLoader pass in it run to its real length,
reaches half of the process group's timeout (a warning) or the timeout itself (an error). Capped passes make the
measured span short; the projection scales each pass's time by its real length over the batches it handed out.
Without a length (an iterable dataset) the projection is unknown and the measured span alone is compared.
"""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.following import Following, FollowSummary
from ddp_doctor.core.ranks import rank_list

__all__ = ["counted_uneven", "following_findings", "following_section", "loader_name", "timeout_fix", "unchecked"]

NO_LOADER = (
    "No epoch end was reached: the observed steps did not train on a DataLoader pass (a step-based loop, like "
    "nanoGPT's), so the check stopped after them."
)


def _seconds(x: float) -> str:
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s" if x < 10 else f"{x:.0f} s"


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


_RAISE_TIMEOUT = {
    "torch": "dist.init_process_group(..., timeout=datetime.timedelta(minutes=60))",
    "accelerate": "Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=60))])",
    "transformers": "TrainingArguments(..., ddp_timeout=3600)",
    "lightning": "Trainer(strategy=DDPStrategy(timeout=datetime.timedelta(minutes=60)))",
}


def timeout_fix(framework: str | None) -> str:
    """`timeout-risk`'s fix, the timeout raised in the words of the framework that built the DDP model."""
    raise_it = _RAISE_TIMEOUT.get(framework or "torch", _RAISE_TIMEOUT["torch"])
    return (
        "run that work on every rank, each on its shard (a DistributedSampler on the evaluation set, then all_reduce "
        f"the metric), or move it where no rank waits for it, or raise the timeout knowingly: {raise_it}."
    )


def following_findings(
    summary: FollowSummary | None,
    *,
    framework: str = "torch",
    lengths_compared: bool = False,
    parallelism: str = "ddp",
    world: int = 0,
) -> list[Finding]:
    """The findings of following. `uneven-inputs` from the counted passes comes whether or not anything was
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
            r = summary.repeated_epoch
            site = f"created at {r['site']}" if r["site"] else None
            own.append(rules.sampler_epoch_repeated(epoch=r["epoch"], ranks=r["ranks"], site=site, seen=r["seen"]))
    uneven = [*own, *counted_uneven(summary.loaders, lengths_compared=lengths_compared)]
    if not summary.followed:
        return uneven
    return [*uneven, *_mismatch(summary), *_timeout_risk(summary, framework)]


def lengths_uneven(loaders: list[dict[str, Any]], parallelism: str, world: int) -> list[Finding]:
    """`uneven-inputs` for each training loader whose `len()` differs across ranks (the path without DDP, whose
    observed steps compare none)."""
    findings = []
    for d in loaders:
        b = d.get("batches") or {}
        if not d.get("training") or b.get("min") is None or b["min"] == b["max"]:
            continue
        shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(b["by_rank"]) if n is not None)
        findings.append(
            rules.uneven_inputs(
                title=f"ranks have different numbers of batches per epoch from the DataLoader {loader_name(d)} "
                f"({shown})",
                cause=f"len() of the DataLoader differs across ranks, {b['min']} to {b['max']} batches: the ranks "
                f"with {b['min']} run out while the others still train",
                note=_sampler(d.get("sampler")),
                ranks=list(range(max(world, len(b["by_rank"])))),
                steps=[],
                parallelism=parallelism,
            )
        )
    return findings


def loader_name(d: dict[str, Any]) -> str:
    """`built at file:line`, or `#2 built at file:line` for the second of the loaders built together there."""
    site = d.get("site") or "at an unknown line"
    return f"#{d['ordinal']} built at {site}" if d.get("ordinal", 1) > 1 else f"built at {site}"


def _per_rank(c: dict[str, Any]) -> str:
    """`rank 0: 5, rank 1: 4` for the first ranks (`at least 3` where the check ended that rank's pass)."""
    shown = []
    for r, (n, floor) in enumerate(zip(c["by_rank"], c["at_least_by_rank"])):
        shown.append(f"rank {r}: {n}" if n is not None else f"rank {r}: at least {floor}" if floor else "")
    return ", ".join(x for x in shown if x)


def _sampler(sampler: str | None) -> str:
    if not sampler:
        return ""
    if sampler.startswith("_Infinite"):  # the placeholder DataLoader gives an IterableDataset
        return "It streams an IterableDataset (no sampler): each rank's share is whatever its __iter__ yields there."
    return f"Its sampler: {sampler}."


def counted_uneven(loaders: list[dict[str, Any]], *, lengths_compared: bool = False) -> list[Finding]:
    """`uneven-inputs` for each loader whose ranks handed out different numbers of batches in one pass, counted as
    the passes ran (with or without `len()`): an error for a training loader, a warning for another one."""
    findings = []
    for d in loaders:
        c = d.get("counted") or {}
        if not c.get("uneven"):
            continue
        b = d["batches"]
        if lengths_compared and d["training"] and b["min"] is not None and b["min"] != b["max"]:
            continue  # the observed steps' finding already compares its len() per rank
        name = f"the DataLoader {loader_name(d)}"
        ranks, more = c.get("fewest_ranks", []), c.get("more_fewest", 0)
        who = rank_list(ranks, more=more) if ranks else "some ranks"
        counted = (
            "Counted as the passes ran (the loader has no len(); ddp-doctor counts each rank's batches per pass): "
            if d.get("no_len")
            else "Counted as the passes ran: "
        )
        per_rank = _per_rank(c)
        epoch = f"pass {c['pass']} of {name}"
        if d["training"]:
            finding = rules.uneven_inputs(
                title=f"ranks have different numbers of batches per epoch from {name} ({per_rank})",
                cause=f"{counted}in {epoch}, {who} ran out after {c['min']} batches, while the others still train",
                note=f"{_sampler(d.get('sampler'))} Batches per rank in that pass: {per_rank}.".strip(),
                ranks=ranks,
                steps=[],
            )
        else:
            finding = Finding(
                code=Code.UNEVEN_INPUTS,
                severity="warning",
                title=f"ranks get different numbers of batches from {name}, which no optimizer step trained on "
                f"({per_rank})",
                detail=f"{counted}in {epoch}, {who} ran out after {c['min']} batches while the others went on (up "
                f"to {c['max']}). A loop over it (an evaluation, say) ends at a different batch on each rank: "
                "harmless while it issues no collective per batch, but a forward through the DDP wrapper (a buffer "
                "broadcast) or an all_reduce of a metric per batch then pairs with the wrong batch on the other "
                "ranks and hangs at the end; a metric averaged per rank weighs the ranks unequally.",
                ranks=ranks,
                steps=[],
                fix="give every rank the same number of batches (a DistributedSampler, or shards of equal size), or "
                "keep the loop free of collectives and all_reduce the summed metric and the sample count once, after "
                "it.",
            )
        finding.more_ranks = more
        findings.append(finding)
    return findings


def unchecked(
    summary: FollowSummary | None, *, epochs: int, limit: int, steps: int, watched: bool = False
) -> list[str]:
    """What the check did not run or could not see, in sentences: the epoch end with `--follow-epochs 0` (`watched`:
    the rest of the job), and the loaders without len() whose passes the check capped."""
    out = []
    if watched:
        out.append(
            f"After its {steps} observed step(s) the job trained on under watch, which from then on looks for hangs "
            "and failures, and compares only the parameters of the DDP models across this node's ranks every few "
            "steps: the gradients, buffers, inputs, optimizer settings and the epoch ends (evaluation, checkpoint "
            "saves, the collectives there) of the later steps were not compared."
        )
    elif epochs == 0:
        out.append(
            f"--follow-epochs 0: the script was stopped right after its {steps} observed step(s); its epoch end "
            "(evaluation, checkpoint saves, the collectives there) and every later epoch went unchecked, and a "
            "DataLoader pass still open then was never counted to its end. Leave --follow-epochs at 1 (the "
            "default) to follow one epoch end."
        )
    for d in summary.loaders if summary is not None else []:
        c = d.get("counted") or {}
        if not d.get("no_len") or not d["capped"] or c.get("uneven"):
            continue
        name = f"The DataLoader {loader_name(d)}"
        if c.get("all_first_counted"):
            each = f" ({c['min']} each)" if c.get("min") == c.get("max") else ""
            out.append(
                f"{name} has no len(): its batches were counted on every rank in its first pass{each}, but a later "
                f"pass was capped by the check (at {limit} batch(es), or where the observed steps ended), so a "
                "difference between the ranks' counts in later epochs (shards that change per epoch, say) would not "
                "show."
            )
        else:
            out.append(
                f"{name} has no len(), and the check ended its passes before they ran to their end on every rank "
                f"(after the observed steps, then at {limit} batch(es)): its batches per rank were never counted, so "
                "ranks with different numbers of batches per epoch would not show. Raise --steps above its batches "
                "per epoch to count a whole pass."
            )
    return out


def _mismatch(s: FollowSummary) -> list[Finding]:
    differ = {k: v for k, v in s.counts.items() if v[0] != v[1]}
    if s.lone_broadcasts and s.more_ranks:
        return [_lone_broadcast(s)]
    if not differ:
        return []
    words = {
        "collective": "the script's collectives",
        "ddp-broadcast": "DDP's buffer broadcasts (one per forward through the wrapper that syncs buffers)",
        "ddp-step": "DDP's gradient all-reduces (synced backward passes)",
    }
    counted = "; ".join(f"{words[k]}: {lo} to {hi} per rank" for k, (hi, lo) in differ.items())
    sites = f" The extra forward through the DDP wrapper is at {', '.join(s.extra_sites)}." if s.extra_sites else ""
    ranks = s.more_ranks
    broadcast = "ddp-broadcast" in differ
    return [
        Finding(
            code=Code.COLLECTIVE_MISMATCH,
            severity="error",
            title=f"after the observed steps, {rank_list(ranks) if ranks else 'some ranks'} issued more collectives "
            "than the others (at the epoch end)",
            detail=f"While following the script through its epoch end, the ranks did not issue the same collectives: "
            f"{counted}.{sites} Collectives pair up by position, so the ranks with more pair theirs with the others' "
            "next ones: tensors of different meaning get combined silently, and the job hangs or crashes when the "
            "counts no longer line up (at the end of training, at the latest)."
            + (
                " A forward through the DDP wrapper broadcasts rank 0's buffers (broadcast_buffers=True and the model "
                "has buffers, BatchNorm say), even under torch.no_grad() in eval mode, right after a training step."
                if broadcast
                else ""
            ),
            params=[],
            ranks=ranks,
            steps=[],
            fix="evaluate through the inner module (ddp_model.module(x)) under torch.no_grad(), or run the evaluation "
            "on every rank (each on its shard)."
            if broadcast
            else "issue the same collectives on every rank: run the code that calls them on every rank.",
        )
    ]


def _lone_broadcast(s: FollowSummary) -> Finding:
    who = rank_list(s.more_ranks)
    where = f" at {', '.join(s.extra_sites)}" if s.extra_sites else ""
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        title=f"{who} called the DDP model without autograd{where} after the observed steps; the other ranks did not",
        detail=f"At the epoch end the check followed, {who} ran a forward through the DDP wrapper under "
        f"torch.no_grad(){where} (an evaluation, say) that the other ranks did not run. With broadcast_buffers=True "
        "and a model with buffers (BatchNorm), DDP broadcasts rank 0's buffers at the first such forward after a "
        "training step: a collective the other ranks pair with the broadcast of their next training forward (DDP "
        "then skips that rank's next one, so the counts can still agree). The pairing is silently wrong, and when "
        "no training forward follows (an evaluation after the last epoch) the broadcast is never matched and the "
        "job hangs or dies at its end.",
        params=[],
        ranks=s.more_ranks,
        steps=[],
        fix="evaluate through the inner module (ddp_model.module(x)) under torch.no_grad(), or run the evaluation "
        "on every rank (each on its shard).",
    )


def _timeout_risk(s: FollowSummary, framework: str) -> list[Finding]:
    alone, timeout = s.alone, s.timeout_s
    if alone is None or not timeout:
        return []
    value = alone.projected_s if alone.projected_s is not None else alone.measured_s
    if value < timeout / 2:
        return []
    reaches = value >= timeout
    projection = (
        f"about {_seconds(alone.projected_s)} at the loaders' real lengths"
        if alone.projected_s is not None
        else "the projection to the real lengths is unknown (a loader without len())"
    )
    passes = f" Capped DataLoader passes in that span: {'; '.join(alone.passes)}." if alone.passes else ""
    return [
        Finding(
            code=Code.TIMEOUT_RISK,
            severity="error" if reaches else "warning",
            title=f"rank {alone.rank} works alone for {projection if alone.projected_s is not None else _seconds(value)}"
            f" while the others wait; the process group's timeout is {_seconds(timeout)}",
            detail=f"Between {alone.start} and {alone.end}, rank {alone.rank} worked alone for "
            f"{_seconds(alone.measured_s)} as measured with capped loaders ({projection}) while every other rank "
            f"waited for it in {alone.end}.{passes} "
            + (
                f"That reaches the process group's timeout of {_seconds(timeout)}: in the real run the waiting ranks' "
                "collective times out at this point (gloo raises a timeout error; NCCL's watchdog aborts the job)."
                if reaches
                else f"That is more than half of the process group's timeout of {_seconds(timeout)}: a slower "
                "machine, a bigger evaluation set or a busy file system takes it over the timeout."
            ),
            params=[],
            ranks=[alone.rank],
            steps=[],
            fix=timeout_fix(framework),
        )
    ]
