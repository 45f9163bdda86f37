"""The words of `collective-mismatch`: a title, a detail and a fix for each kind of evidence
`collective_order.py` finds the ranks' collectives apart by. Each function reads the evidence (ranks, steps, sites,
counts, calls) and returns the three sentences; nothing here decides whether the ranks parted, and nothing reads a
sentence back.
"""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.positions import capped, short, where
from ddp_doctor.core.fr_dumps import FrEntry
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.rankstate import RankState

__all__ = [
    "Words",
    "beacons_words",
    "broadcast_words",
    "dumps_words",
    "followed_words",
    "lone_broadcast_words",
    "sequence_words",
    "synced_passes_words",
    "unpaired_words",
]

Words = dict[str, str]
"""`title`, `detail` and `fix` of one finding."""

_SAME_ORDER_FIX = (
    "make every rank of the group call the same collectives, in the same order, with the same dtype, shape and "
    "reduction: compute rank-dependent choices (which metric, which op) from values agreed across ranks first."
)
_EVAL_FIX = (
    "evaluate through the inner module (ddp_model.module(x)) under torch.no_grad(), or run the evaluation on every "
    "rank (each on its shard)."
)


def _also(steps: list[int], what: str = "step(s)") -> str:
    return f" Also in {what} {list(steps)}." if steps else ""


def sequence_words(
    *,
    step: int,
    reference: int,
    shown: list[tuple[int, str | None]],
    position: int | None,
    odd: str,
    differ: int,
    counts: list[int],
    also: list[int],
) -> Words:
    """The calls of `step` through torch.distributed differed (`shown`: each rank's call at the first `position`
    where they part, None where it called nothing more)."""
    if position is None:
        at = "the calls beyond the logged ones differ"
    else:
        said = [
            f"rank {r} called {call.replace('/', ' over a group of ', 1)}" if call else f"rank {r} called nothing more"
            for r, call in shown
        ]
        at = f"at its collective #{position + 1} of the step, " + "; ".join(said)
    return {
        "title": f"the ranks issued different collectives in step {step} ({odd} differ{'s' if differ == 1 else ''} "
        f"from rank {reference})",
        "detail": f"In step {step} the collectives called through torch.distributed (the script's, and FSDP2's for a "
        f"sharded model) were not the same on every rank: {at}. "
        + (f"The ranks issued {' to '.join(map(str, counts))} collectives in that step. " if len(counts) > 1 else "")
        + "Collectives pair up by position, so each rank combined a different tensor or reduction than it "
        "meant to, silently, or waits for a peer that never comes." + _also(also),
        "fix": _SAME_ORDER_FIX,
    }


def synced_passes_words(
    *, extra: str, rest: str, first: int, most: int, least: int, sites: list[str], also: list[int], every: bool
) -> Words:
    """`extra` ranks ran `most` synced backward passes through DDP in optimizer step `first`, `rest` `least`;
    `every`: in every observed step (micro-batches accumulated with sync on, more of them on some ranks)."""
    at = f" (the extra pass starts at {', '.join(sites)})" if sites else ""
    return {
        "title": f"{extra} ran {most} synced backward passes in optimizer step {first}, {rest} {least}",
        "detail": f"In optimizer step {first}{at}, the ranks ran different numbers of backward passes through DDP "
        "with gradient sync on. Each synced backward issues DDP's gradient all-reduces, so the extra ones on "
        "one rank are paired with the other ranks' next ones: gradients of different steps get averaged, "
        "and the job hangs or crashes when the counts no longer line up."
        + (f" It happened again in optimizer step(s) {also}." if also else ""),
        "fix": "run the same number of synced forward/backward passes on every rank in each step: "
        + (
            "accumulate the same number of micro-batches on every rank (computed from values every rank holds), "
            "with all but the last under ddp.no_sync()."
            if every
            else "decide the retry from a value all-reduced across ranks, or run the extra pass under ddp.no_sync()."
        ),
    }


def unpaired_words(
    *, extra: str, rest: str, first: int, more_forwards: int, sites: list[str], broadcasts: bool, also: list[int]
) -> Words:
    """`extra` ranks ran DDP's forward in grad mode `more_forwards` more times than `rest` in step `first`, with no
    backward; `broadcasts`: that forward broadcasts buffers (the model has some, broadcast_buffers=True)."""
    at = f" at {', '.join(sites)}" if sites else ""
    consequence = (
        "DDP's forward broadcasts rank 0's buffers (broadcast_buffers=True and the model has buffers), a collective "
        "the other ranks do not issue at that point: their next collectives are paired with it, and the job hangs "
        "or averages the wrong tensors."
        if broadcasts
        else "This run went on because the model has no buffers for DDP to broadcast in that forward, so it issued no "
        "collective there; with buffers (BatchNorm, say) and broadcast_buffers=True the same line broadcasts them on "
        "these ranks alone, a collective the other ranks never join, and the job hangs (measured on torch 2.13)."
    )
    return {
        "title": f"{extra} ran DDP's forward with autograd on and no backward{at} in step {first}; {rest} did not",
        "detail": f"In step {first}, {extra} called the DDP model in grad mode {more_forwards} more time(s) than "
        f"{rest}, and no backward followed{at} (an evaluation through the DDP wrapper, say). "
        + consequence
        + (f" Also in step(s) {also}." if also else ""),
        "fix": "evaluate on one rank under torch.no_grad() through the inner module (ddp_model.module(x)), or run the "
        "evaluation on every rank.",
    }


def broadcast_words(
    *, extra: str, rest: str, first: int, sites: list[str], uneven: list[int], also: list[int]
) -> Words:
    """`extra` ranks broadcast DDP's buffers from a forward without grad in step `first`, `rest` did not; `uneven`:
    the steps whose counts of broadcasts per optimizer step differed too."""
    at = f" at {', '.join(sites)}" if sites else ""
    counts = (
        f" Counted by optimizer step, the ranks also issued different numbers of buffer broadcasts in step(s) {uneven}."
        if uneven
        else ""
    )
    return {
        "title": f"{extra} broadcast DDP's buffers from a forward without grad{at} in step {first}; {rest} did not",
        "detail": f"In step {first}, {extra} called the DDP model without grad{at} (an evaluation through the DDP "
        "wrapper, say), and DDP's forward broadcast rank 0's buffers there: it does at every forward that "
        "follows a synced training forward when broadcast_buffers=True and the model has buffers (BatchNorm), "
        f"in eval mode and under torch.no_grad() too. {rest} issued no broadcast at that point. A forward "
        "without grad also makes DDP skip the broadcast of the next forward, so on those ranks the broadcast moved "
        "from their next training forward to the evaluation, and the other ranks pair it with the next "
        "collective they issue. The observed steps got through because that was their next forward's broadcast; "
        "when something else comes first on them (a dist.barrier() or an all_reduce of metrics after the "
        "evaluation, DDP's gradient all-reduce when the evaluation runs between forward and backward, the end of "
        "training), the collectives pair with the wrong ones and the job hangs (measured with gloo on torch 2.13)."
        + counts
        + (f" Also in step(s) {also}." if also else ""),
        "fix": "evaluate through the inner module (ddp_model.module(x)) under torch.no_grad(), or run the evaluation "
        "on every rank.",
    }


_FOLLOWED = {
    "collective": "the script's collectives",
    "ddp-broadcast": "DDP's buffer broadcasts (one per forward through the wrapper that syncs buffers)",
    "ddp-step": "DDP's gradient all-reduces (synced backward passes)",
}


def followed_words(*, differ: dict[str, tuple[int, int]], ranks: list[int], extra_sites: list[str]) -> Words:
    """At the epoch end followed, the ranks' counts of the kinds in `differ` ((most, fewest) each) differed."""
    counted = "; ".join(f"{_FOLLOWED[k]}: {lo} to {hi} per rank" for k, (hi, lo) in differ.items())
    sites = f" The extra forward through the DDP wrapper is at {', '.join(extra_sites)}." if extra_sites else ""
    broadcast = "ddp-broadcast" in differ
    return {
        "title": f"after the observed steps, {rank_list(ranks) if ranks else 'some ranks'} issued more collectives "
        "than the others (at the epoch end)",
        "detail": "While following the script through its epoch end, the ranks did not issue the same collectives: "
        f"{counted}.{sites} Collectives pair up by position, so the ranks with more pair theirs with the others' "
        "next ones: tensors of different meaning get combined silently, and the job hangs or crashes when the "
        "counts no longer line up (at the end of training, at the latest)."
        + (
            " A forward through the DDP wrapper broadcasts rank 0's buffers (broadcast_buffers=True and the model "
            "has buffers, BatchNorm say), even under torch.no_grad() in eval mode, right after a training step."
            if broadcast
            else ""
        ),
        "fix": _EVAL_FIX
        if broadcast
        else "issue the same collectives on every rank: run the code that calls them on every rank.",
    }


def lone_broadcast_words(*, ranks: list[int], extra_sites: list[str]) -> Words:
    """At the epoch end followed, `ranks` alone ran a forward through the DDP wrapper without autograd at
    `extra_sites`, with the counts alike."""
    who = rank_list(ranks)
    at = f" at {', '.join(extra_sites)}" if extra_sites else ""
    return {
        "title": f"{who} called the DDP model without autograd{at} after the observed steps; the other ranks did not",
        "detail": f"At the epoch end the check followed, {who} ran a forward through the DDP wrapper under "
        f"torch.no_grad(){at} (an evaluation, say) that the other ranks did not run. With broadcast_buffers=True "
        "and a model with buffers (BatchNorm), DDP broadcasts rank 0's buffers at the first such forward after a "
        "training step: a collective the other ranks pair with the broadcast of their next training forward (DDP "
        "then skips that rank's next one, so the counts can still agree). The pairing is silently wrong, and when "
        "no training forward follows (an evaluation after the last epoch) the broadcast is never matched and the "
        "job hangs or dies at its end.",
        "fix": _EVAL_FIX,
    }


def dumps_words(
    *,
    name: str,
    seq: int,
    sides: list[tuple[list[int], FrEntry | None, int]],
    dumped: list[int],
    missing: list[int],
    start: int,
) -> Words:
    """At collective #`seq` of group `name`, each side (ranks, the entry they issued or None, their last sequence
    number) issued its own; `dumped` ranks left dumps, `missing` members none; every collective from #`start` on
    matched."""
    said = [
        f"{rank_list(ranks)} issued none (its last was #{last})"
        if e is None
        else f"{rank_list(ranks)} issued {e.describe()} at {e.line or 'an unknown line'}"
        for ranks, e, last in sides
    ]
    return {
        "title": f"at collective #{seq} of {name}, " + " where ".join(said),
        "detail": f"Flight Recorder dumps of {rank_list(dumped)}: at collective #{seq} of {name}, "
        + "; ".join(said)
        + f". Every earlier collective of the group in the dumps (from #{start}) matched on every rank."
        + (f" {rank_list(missing)} left no dump." if missing else ""),
        "fix": "make every rank of the group call the same collectives in the same order: a collective inside a "
        "rank-dependent branch (a save or an evaluation on rank 0) must move out of it, or be called on every rank.",
    }


def beacons_words(
    *,
    first: RankState,
    behind: list[RankState],
    different: list[RankState],
    culprits: list[int],
    signals: list[str],
    earlier: bool = False,
    sent: bool = False,
) -> Words:
    """A failed run's parting: `first` waited in its collective (`earlier`: called it, and went on past it; `sent`:
    sent it as a broadcast's root and went on),
    `behind` never called one at that position, `different` called another there; `signals` say which ranks died
    of an abort or a segfault."""
    c: Any = first.collective
    parts = [
        f"rank {first.rank} called {c.describe()} at {c.site or 'an unknown place'} in step "
        # (no doctor counts a sharded model's steps when the collective starts: the rank's own count, where it
        # still waits)
        f"{c.step if c.step is not None else max(first.step, 0)} (its collective #{c.n})"
        + (
            ", and the ranks went on, each next collective paired with another"
            if earlier
            else ", sent it as the root and went on (a broadcast's root does not wait for its receivers)"
            if sent
            else " and waited there"
        )
    ]
    for s in behind:
        parts.append(
            f"rank {s.rank} never called it: it had issued {s.collectives} collective(s) (the script's and DDP's "
            f"buffer broadcasts) and went on to {where(s)}"
            + (
                "; the sharded model's next collectives on that rank (the all-gathers of its forward) wait for it"
                if s.sharded and not s.in_collective
                else "; the collectives of DDP's next forward on that rank (its buffer broadcast, its rebuild of the "
                "gradient buckets after the first step) were paired with it"
                if s.phase == "forward" and not s.in_collective
                else "; DDP's next gradient all-reduce on that rank was paired with it"
                if s.phase in ("backward", "after backward") or not s.in_collective
                else ""
            )
        )
    for s in different:
        o: Any = s.collective
        parts.append(f"rank {s.rank} called {o.describe()} at {o.site or 'an unknown place'} at the same position")
    return {
        "title": (
            f"{rank_list(culprits)} skipped {c.op} ({short(c.site)}) that rank {first.rank} called"
            if behind and not different
            else f"ranks called different collectives at position {c.n}: {c.describe()} on rank {first.rank}"
        ),
        "detail": capped(parts)
        + "."
        + (f" {capped(signals)} (gloo aborts a process whose peer issued a different collective)." if signals else ""),
        "fix": (
            f"the model at {c.site or 'that line'} is a copy of a DDP model (made at {c.copied_at}), and like the "
            "original it broadcasts its buffers from rank 0 at each forward: copy the inner module instead "
            "(AveragedModel(ddp_model.module), copy.deepcopy(ddp_model.module)), or run that forward on every rank."
            if c.ddp_buffers and c.copied_at
            else f"a forward through a DDP model broadcasts its buffers from rank 0 (broadcast_buffers=True): run the "
            f"forward at {c.site or 'that line'} on every rank, or on one rank through the wrapped module "
            "(ddp_model.module(x)) under torch.no_grad(), which issues no collective."
            if c.ddp_buffers
            else f"give {c.op} at {c.site or 'that line'} the same dtype and shape on every rank: agree on the size "
            "first (all_reduce the length, or broadcast_object_list), then pad or slice to it."
            if different and all(s.collective.op == c.op for s in different) and not behind
            else f"make every rank of the group call the same collectives in the same order: move {c.op} at "
            f"{c.site or 'that line'} out of the rank-dependent branch (compute the condition on every rank, "
            f"or all_reduce a flag first), or call it on every rank."
        ),
    }
