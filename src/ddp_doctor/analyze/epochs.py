"""Data-sharding findings, decided here for every parallelism and every source of facts: `uneven-inputs` (the
observed steps' loaders, the `len()` per rank and the batches counted per pass while following the epoch end, and a
failed sharded run whose shortest loader ran out) and `sampler-epoch-not-set` (observed steps, or followed). Pure:
reads the ranks' loader facts."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.common import with_evidence, with_more
from ddp_doctor.analyze.positions import capped, positions, where
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.following import JoinedLoop
from ddp_doctor.core.ranks import rank_list, rank_ranges
from ddp_doctor.core.rankstate import RankState

__all__ = [
    "counted_uneven",
    "drawn_apart",
    "drawn_apart_at_step",
    "followed_epoch_repeated",
    "lengths_uneven",
    "loader_name",
    "ran_out_alone",
    "sampler_epoch_not_set",
    "training_loader",
    "uneven_inputs",
]


def batches(most: int, fewest: int) -> list[Measure]:
    """The evidence of batch counts that differ across ranks: the most and the fewest any rank got."""
    return [Measure("batches_most", most, "count"), Measure("batches_fewest", fewest, "count")]


def batches_by_rank(counts: Iterable[tuple[int, int]]) -> list[Measure]:
    """Each (rank, batches) pair as the evidence `batches (rank R)`."""
    return [Measure(f"batches (rank {r})", n, "count") for r, n in counts]


def joined_uneven(
    shown: str, out: str, ranks: list[int], steps: list[int], joined: JoinedLoop, counts: tuple[int, int]
) -> Finding:
    """Uneven batch counts (`shown` per rank; `out`: who runs out after how many; `counts`: the most and the fewest)
    inside the script's `Join`: handled, so an ``info``, measured with the batches after which the epoch ends (the
    most, while the ranks that ran out shadow the others; the fewest, when the Join throws). Ground truth (tests/lockstep/test_joined.py, plain torchrun): 5 and 8 batches per rank
    under `Join([model])`, exit 0, the weights equal; under `throw_on_early_termination=True` (the script catching
    the Join's error) exit 0, the weights equal, and every rank trains 5 batches per epoch."""
    if joined.throws:
        detail = (
            f"{out} batches; the loop runs inside Join with throw_on_early_termination=True ({joined.site}), so "
            "once a rank runs out every rank raises at that point and the epoch ends there, and nothing hangs: the "
            "batches the other ranks hold beyond the fewest are not trained in that epoch."
        )
        fix = (
            "nothing is required; to train every batch, give every rank the same number (shard with "
            "DistributedSampler, equal shares)."
        )
    else:
        detail = (
            f"{out} batches; the loop runs inside Join ({joined.site}), so a rank that runs out shadows the others' "
            "collectives until every rank has joined, and nothing hangs. In the shadowed steps DDP averages the "
            "gradients of fewer ranks (divided by the initial world size, by default: smaller steps)."
        )
        fix = (
            "nothing is required; to train every rank on the same number of batches instead, shard with "
            "DistributedSampler (equal shares) or use drop_last=True."
        )
    most, fewest = counts
    return Finding(
        code=Code.UNEVEN_INPUTS,
        severity="info",
        measured=[
            Measure("epoch_ends_after_batches", fewest if joined.throws else most, "count"),
            *batches(most, fewest),
        ],
        title=f"ranks have different numbers of batches per epoch ({shown}), handled by Join",
        detail=detail,
        ranks=ranks,
        steps=steps,
        sites=lines_of(joined.site),
        fix=fix,
    )


def training_loader(meta: dict[str, Any]) -> dict[str, Any]:
    """The first loader the rank iterated while observed that has a length (the training loop's, in practice)."""
    return next((d for d in meta["loaders"] if d.get("batches") is not None), {})


@detects(Code.UNEVEN_INPUTS)
def uneven_inputs(v: View) -> list[Finding]:
    s = v.summary
    if v.world < 2:
        return []
    if s.drawn_step is not None:
        return []  # a step's batches drawn apart: `drawn_apart_at_step` says so, for every parallelism
    if s.loader_ranks < v.world:
        return []
    most, fewest = s.batches
    if most != fewest:
        short = v.ranks("fewest-batches")
        shown = ", ".join(f"rank {r}: {c}" for r, c in enumerate(s.first_batches[:8]))
        names = rank_ranges(short.ranks, more=short.more)
        sampler = training_loader(v.meta(short.ranks[0])).get("sampler")
        if joins := v.meta(0).get("join_sites"):
            out = f"{'Ranks' if short.count > 1 else 'Rank'} {names} run{'' if short.count > 1 else 's'} out after {fewest}"
            joined = JoinedLoop(joins[0], throws=joins[0] in v.meta(0).get("join_throws", []))
            return [joined_uneven(shown, out, list(range(v.world)), [fewest], joined, (most, fewest))]
        finding = rules.uneven_inputs(
            title=f"ranks have different numbers of batches per epoch ({shown})",
            cause=f"{'Ranks' if short.count > 1 else 'Rank'} {names} run{'' if short.count > 1 else 's'} out after "
            f"{fewest} batches, at batch {fewest} of the first epoch, while the others still train",
            note=f"Sampler: {sampler}.",
            ranks=list(range(v.world)),
            steps=[fewest],
        )
        per_rank = batches_by_rank(enumerate(s.first_batches[:8]))
        site = training_loader(v.meta(short.ranks[0])).get("site")
        return [with_evidence(finding, sites=[site] if site else [], measured=[*batches(most, fewest), *per_rank])]
    if s.padded:
        d = training_loader(v.meta(0))
        pad = s.padded
        return [
            Finding(
                code=Code.UNEVEN_INPUTS,
                severity="info",
                title=f"equal batch counts only thanks to {pad} padded sample(s)",
                detail=f"DistributedSampler(drop_last=False) repeats {pad} sample(s) so that the {d.get('dataset')} "
                f"samples split evenly over {v.world} ranks: every rank gets {fewest} batches, and those samples "
                "count twice in each epoch. Harmless for training; it skews an evaluation metric.",
                ranks=list(range(v.world)),
                steps=[],
                fix="DistributedSampler(..., drop_last=True) drops them instead; for evaluation, count only the first "
                "len(dataset) samples.",
            )
        ]
    return []


@detects(Code.UNEVEN_INPUTS, road="every")
def drawn_apart_at_step(a: Agreed) -> list[Finding]:
    """Ranks that drew different numbers of batches from the training loader for one observed step, whatever the
    parallelism (a batch skipped on some ranks with `continue`)."""
    if (d := a.drawn_apart) is None:
        return []
    found = drawn_apart(
        step=d.step, ranks=d.ranks, more=d.more, drew=d.drew, others=d.others, site=d.site, parallelism=a.parallelism
    )
    return [found]


def drawn_apart(
    *, step: int, ranks: list[int], more: int, drew: int, others: int, site: str | None, parallelism: str
) -> Finding:
    """`uneven-inputs` for every parallelism: `ranks` (and `more` others) drew `drew` batches from the training
    loader (created at `site`) for optimizer step `step` where other ranks drew `others` (a batch skipped on some
    ranks with `continue`): the ranks take different numbers of steps per epoch.

    Ground truth (tests/lockstep/test_drawn.py): under plain torchrun, rank 1 skipping one batch of 16 finished its
    epoch after 15 steps while rank 0 took 16; the ranks' all-reduces paired steps of different batches from then
    on, and at the end rank 0 crashed in its last backward ("Connection closed by peer") when rank 1 left."""
    names = rank_ranges(ranks, more=more)
    many = len(ranks) + more > 1
    finding = rules.uneven_inputs(
        title=f"{'ranks' if many else 'rank'} {names} drew {drew} batch{'es' if drew != 1 else ''} from the "
        f"training loader for step {step} where other ranks drew {others}: the ranks take different numbers of "
        "optimizer steps per epoch",
        cause=f"A batch drawn without an optimizer step on some ranks only (a `continue` past a bad sample, a "
        f"rank-local condition) moves their epoch's end a step: from step {step} on, each gradient reduction "
        "averages batches from different positions of the epoch, and the ranks that drew more run out while the "
        "others still train",
        ranks=ranks,
        steps=[step],
        parallelism=parallelism,
        fix="decide the skip together: flag = torch.tensor(float(bad), device=device); dist.all_reduce(flag, "
        "op=dist.ReduceOp.MAX); if flag: continue (every rank skips the batch), or keep the step on every rank and "
        "drop the batch's contribution (loss = loss * 0).",
    )
    finding.more_ranks = more
    finding.measured = [Measure("batches_drawn", drew, "count"), Measure("batches_drawn_by_others", others, "count")]
    finding.sites = [site] if site else []
    return finding


def _loader_site(d: dict[str, Any]) -> str | None:
    if d.get("site"):
        return f"created at {d['site']}"
    return f"first iterated at {d['iterated_at']}" if d.get("iterated_at") else None


@detects(Code.SAMPLER_EPOCH_NOT_SET)
def sampler_epoch_not_set(v: View) -> list[Finding]:
    """A shuffling DistributedSampler whose loader started a pass again with the sampler's epoch unchanged.

    Only a loader iterated more than once while observed tells: a loop that stayed in its first epoch, a
    non-shuffling sampler, or a loader no optimizer step took a batch from (an evaluation loader's, whose order does
    not matter, even with DistributedSampler's default shuffle=True) says nothing.
    """
    findings: list[Finding] = []
    for meta in [v.meta(0)]:  # every rank's loop has the same shape; rank 0 speaks for it
        for d in meta["loaders"]:
            if d.get("sampler") != "DistributedSampler" or not d.get("shuffle") or d.get("epochs_started", 1) < 2:
                continue
            if d.get("trained") is False:  # an evaluation loader: the order it visits samples in does not matter
                continue
            seen = [e for e in d.get("epochs_seen", []) if e is not None]
            if any(a == b for a, b in itertools.pairwise(seen)):
                site = _loader_site(d)
                found = rules.sampler_epoch_repeated(epoch=seen[-1], ranks=list(range(v.world)), site=site, seen=seen)
                findings.append(with_evidence(found, sites=[site or ""], measured=_epochs_seen(seen[-1], seen)))
    return findings


def _epochs_seen(epoch: int | None, seen: list[int]) -> list[Measure]:
    """The evidence of a sampler's epoch that repeated: the passes counted, and the epoch they started with."""
    return [Measure("passes", len(seen), "count")] + ([Measure("epoch", epoch, "value")] if epoch is not None else [])


def followed_epoch_repeated(r: dict[str, Any]) -> Finding:
    """`sampler-epoch-not-set` from following (the path without DDP): `FollowSummary.repeated_epoch`."""
    site = f"created at {r['site']}" if r["site"] else None
    found = rules.sampler_epoch_repeated(epoch=r["epoch"], ranks=r["ranks"], site=site, seen=r["seen"])
    return with_evidence(found, sites=[site or ""], measured=_epochs_seen(r["epoch"], r["seen"] or []))


def lengths_uneven(loaders: list[dict[str, Any]], parallelism: str, world: int) -> list[Finding]:
    """`uneven-inputs` for each training loader whose `len()` differs across ranks (the path without DDP, whose
    observed steps compare none)."""
    findings = []
    for d in loaders:
        b = d.get("batches") or {}
        if not d.get("training") or b.get("min") is None or b["min"] == b["max"]:
            continue
        shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(b["by_rank"]) if n is not None)
        finding = rules.uneven_inputs(
            title=f"ranks have different numbers of batches per epoch from the DataLoader {loader_name(d)} ({shown})",
            cause=f"len() of the DataLoader differs across ranks, {b['min']} to {b['max']} batches: the ranks "
            f"with {b['min']} run out while the others still train",
            note=_sampler(d.get("sampler")),
            ranks=list(range(max(world, len(b["by_rank"])))),
            steps=[],
            parallelism=parallelism,
        )
        per_rank = batches_by_rank((r, n) for r, n in enumerate(b["by_rank"]) if n is not None)
        sites = [d["site"]] if d.get("site") else []
        findings.append(with_evidence(finding, sites=sites, measured=[*batches(b["max"], b["min"]), *per_rank]))
    return findings


def loader_name(d: dict[str, Any]) -> str:
    """`built at file:line`, or `#2 built at file:line` for the second of the loaders built together there."""
    site = d.get("site") or "at an unknown line"
    return f"#{d['ordinal']} built at {site}" if d.get("ordinal", 1) > 1 else f"built at {site}"


def _per_rank(c: dict[str, Any]) -> tuple[str, list[Measure]]:
    """`rank 0: 5, rank 1: at least 3` for the first ranks (`at least` where the check ended that rank's pass), and
    the same counts as evidence (`batches at least (rank 1)` for such a lower bound, not a rank's count)."""
    shown, measured = [], []
    for r, (n, floor) in enumerate(zip(c["by_rank"], c["at_least_by_rank"])):
        if n is not None or floor:
            shown.append(f"rank {r}: {n}" if n is not None else f"rank {r}: at least {floor}")
            name = f"batches (rank {r})" if n is not None else f"batches at least (rank {r})"
            measured.append(Measure(name, n if n is not None else floor, "count"))
    return ", ".join(shown), measured


def _sampler(sampler: str | None) -> str:
    if not sampler:
        return ""
    if sampler.startswith("_Infinite"):  # the placeholder DataLoader gives an IterableDataset
        return "It streams an IterableDataset (no sampler): each rank's share is whatever its __iter__ yields there."
    return f"Its sampler: {sampler}."


def counted_uneven(
    loaders: list[dict[str, Any]], *, lengths_compared: bool = False, joined: JoinedLoop | None = None
) -> list[Finding]:
    """`uneven-inputs` for each loader whose ranks handed out different numbers of batches in one pass, counted as
    the passes ran (with or without `len()`): an error for a training loader (an info when the script trains inside
    a Join, `joined`), a warning for another one."""
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
        per_rank, counts = _per_rank(c)
        epoch = f"pass {c['pass']} of {name}"
        if d["training"] and joined:
            finding = joined_uneven(
                per_rank,
                f"{counted}in {epoch}, {who} ran out after {c['min']}",
                ranks,
                [],
                joined,
                (c["max"], c["min"]),
            )
        elif d["training"]:
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
        # The loader's line and counts (after a Join's line and the counts its finding measures itself).
        ordinal = [Measure("loader_ordinal", d["ordinal"], "value")] if d.get("ordinal", 1) > 1 else []
        own = finding.measured or batches(c["max"], c["min"])
        measured = [*own, Measure("pass", c["pass"], "value"), *counts, *ordinal]
        finding = with_evidence(finding, sites=[*finding.sites, d.get("site") or ""], measured=measured)
        findings.append(with_more(finding, more))
    return findings


def ran_out_alone(states: dict[int, RankState]) -> Finding | None:
    """The ranks' training loaders have different lengths, and the failure came after the shortest ran out: the
    rank that ran out went on to what follows its epoch (an evaluation, a save) while the others still trained, and
    their collectives met. Named before what that rank then did alone (`forward_alone` would blame an evaluation
    that every rank runs, at different times)."""
    loaders = {r: s.train_loader for r, s in states.items() if s.sharded and s.train_loader}
    lengths = {r: d["batches"] for r, d in loaders.items() if d.get("batches") is not None}
    if len(lengths) < len(states) or len(set(lengths.values())) < 2:
        return None
    fewest = min(lengths.values())
    short_ranks = sorted(r for r, n in lengths.items() if n == fewest)
    if not any(states[r].step >= fewest for r in short_ranks):
        return None  # the run failed before any rank ran out: another cause
    rest = sorted(r for r in states if r not in short_ranks)
    went = capped([f"rank {r} was at {where(states[r])}" for r in short_ranks + rest])
    shown = ", ".join(f"rank {r}: {n}" for r, n in sorted(lengths.items())[:8])
    site = loaders[short_ranks[0]].get("site") or "an unknown line"
    finding = rules.uneven_inputs(
        title=f"ranks have different numbers of batches per epoch from the DataLoader built at {site} ({shown})",
        cause=f"{rank_list(short_ranks)} ran out after {fewest} batches and went on to what follows the epoch while "
        f"the others still train ({went})",
        ranks=sorted(states),
        steps=[fewest],
        parallelism="fsdp2",
    )
    finding.positions = positions(states, short_ranks + rest)
    per_rank = batches_by_rank(sorted(lengths.items())[:8])
    return with_evidence(finding, sites=[site], measured=[*batches(max(lengths.values()), fewest), *per_rank])
