"""The ranks issue the same collectives in the same order: every `collective-mismatch` whose evidence is the ranks'
sequences of collectives, whatever the source of the facts. The finding and its words are made here, from what each
source found where its facts are reduced (the exchange's per-step digests, the following's counts, the dumps), and
from a failed run's beacons, whose parting `parting.py` finds:

- a step that completed: each step's count and running digest of the calls through torch.distributed, DDP's and a
  sharded model's alike (`collective_sequence_mismatch`, `sequences_apart`);
- the epoch end the check followed: the ranks' counts of collectives there (`followed_apart`);
- a run that failed or hung: each rank's beacon, its last collective and how many it had issued (where they part:
  `parting.beacons_parting`; the finding: `beacons_apart`);
- PyTorch's Flight Recorder dumps of a job that never ran under the doctor (`dumps_apart`);
- DDP's own collectives in a step, counted by their mechanism where the digests cannot tell them apart: extra synced
  backward passes (`synced_pass_mismatch`), a forward in grad mode without a backward (`unpaired_forward_mismatch`),
  a buffer broadcast from a forward without grad (`eval_broadcast_mismatch`).

The words are `collective_words.py`'s, from the evidence found here. Pure: plain data in, `Finding`s out.
"""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.causes import extra_pass
from ddp_doctor.analyze.collective_words import (
    beacons_words,
    broadcast_words,
    dumps_words,
    followed_words,
    lone_broadcast_words,
    sequence_words,
    synced_passes_words,
    unpaired_words,
)
from ddp_doctor.analyze.parting import Parting
from ddp_doctor.analyze.positions import positions
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, lines_of
from ddp_doctor.core.following import FollowSummary
from ddp_doctor.core.fr_dumps import FrDump, FrEntry
from ddp_doctor.core.ranks import rank_list, ranks_label
from ddp_doctor.core.rankstate import RankState
from ddp_doctor.core.summary import Examples

__all__ = [
    "beacons_apart",
    "collective_sequence_mismatch",
    "dumps_apart",
    "eval_broadcast_mismatch",
    "followed_apart",
    "sequences_apart",
    "synced_pass_mismatch",
    "unpaired_forward_mismatch",
]


@detects(Code.COLLECTIVE_MISMATCH, road="every")
def collective_sequence_mismatch(a: Agreed) -> list[Finding]:
    """Ranks whose collectives differed in a step that still completed, whatever the parallelism (the script's
    `torch.distributed` calls; a sharded model's FSDP2 and `replicate` calls too, in order): a different op, shape
    or reduction at the same position, or a different count. The calls of the reference rank and of the ranks that
    differ from it name the first difference. (A mismatch that aborts or hangs the job is named from the ranks'
    beacons instead: `beacons_apart`.)"""
    if a.world < 2 or (apart := a.collectives_apart) is None:
        return []
    calls = {r: apart.held[r] for r in (apart.reference, *apart.ranks) if r in apart.held}
    found = sequences_apart(
        step=apart.step,
        calls=calls,
        odd=apart.ranks,
        more=apart.more,
        counts=a.collectives_counts,
        also=a.collectives_also,
    )
    return [found]


def sequences_apart(
    *,
    step: int,
    calls: dict[int, list[str]],
    odd: list[int],
    more: int = 0,
    counts: list[int] = (),
    also: list[int] = (),
) -> Finding:
    """`collective-mismatch` in a step that completed, for every parallelism: the collectives of `step` called through
    torch.distributed (the script's; FSDP2's and `replicate`'s too) were not the same sequence on every rank. `odd` are
    the ranks whose sequence differs from the reference rank's (the lowest few; `more` others); `calls` maps the
    reference rank (first) and some of `odd` to their calls of the step, in order (`all_reduce(float32[1], MAX)/2 at
    train.py:118`, the first few); `counts` the lowest and highest number of calls, `also` later steps that differed
    too."""
    reference = next(iter(calls))
    signatures = [[c.rsplit(" at ", 1)[0] for c in log] for log in calls.values()]
    position = next(
        (
            i
            for i in range(max((len(s) for s in signatures), default=0))
            if len({s[i] if i < len(s) else None for s in signatures}) > 1
        ),
        None,
    )
    shown = [
        (r, log[position] if position is not None and position < len(log) else None)
        for r, log in list(calls.items())[:4]
    ]
    words = sequence_words(
        step=step,
        reference=reference,
        shown=shown,
        position=position,
        odd=rank_list(odd, more=more),
        differ=len(odd) + more,
        counts=list(counts),
        also=list(also),
    )
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        **words,
        params=[],
        sites=lines_of(*(log[position] for log in calls.values() if position is not None and position < len(log))),
        ranks=sorted({reference, *odd}),
        steps=[step, *also],
        more_ranks=more,
        labels={"kind": "sequence"},
    )


def _apart(v: View, extra: str, fewer: str, sites: str) -> tuple[Examples, Examples, list[str]]:
    """The ranks with more of a DDP mechanism's collectives (predicate `extra`), those with fewer (`fewer`), and the
    lines where the first have them (each example rank's meta `sites`)."""
    more, rest = v.ranks(extra), v.ranks(fewer)
    return more, rest, sorted({site for r in more.ranks for site in v.meta(r)[sites]})


def _by_mechanism(
    words: dict[str, str], *, kind: str, extra: Examples, sites: list[str], steps: list[int], severity: str = "error"
) -> list[Finding]:
    """The finding of DDP's collectives counted by a mechanism (`kind`: `synced-passes`, `forward-without-backward`,
    `broadcast-without-grad`): the `extra` ranks issued more of them, at `sites`, in `steps`."""
    return [
        Finding(
            code=Code.COLLECTIVE_MISMATCH,
            severity=severity,
            **words,
            params=[],
            sites=lines_of(*sites),
            ranks=extra.ranks,
            steps=steps,
            more_ranks=extra.more,
            labels={"kind": kind},
        )
    ]


@detects(Code.COLLECTIVE_MISMATCH)
def synced_pass_mismatch(v: View) -> list[Finding]:
    """Ranks that ran different numbers of synced backward passes through DDP in one optimizer step: each extra
    backward issues DDP's gradient all-reduces once more, which the other ranks pair with their next ones."""
    if v.world < 2:
        return []
    (stepped_hi, stepped_lo), (synced_hi, synced_lo) = v.summary.steps_taken, v.summary.synced
    if synced_hi == synced_lo and stepped_hi != stepped_lo and not extra_pass(v):
        # Synced passes in lockstep, uneven per rank's own steps only because one skipped (`optimizer-step-skipped`).
        return []
    most_by, least_by = v.summary.window_passes
    bad = [k for k in range(v.summary.windows) if most_by[k] != least_by[k]]
    if not bad:
        return []
    first = bad[0]
    extra, rest, sites = _apart(v, "extra-passes", "fewer-passes", "window_sites")
    words = synced_passes_words(
        extra=rank_list(extra.ranks, more=extra.more),
        rest=rank_list(rest.ranks, more=rest.more),
        first=first,
        most=most_by[first],
        least=least_by[first],
        sites=sites,
        also=bad[1:],
        every=len(bad) == v.summary.windows >= 2,
    )
    return _by_mechanism(words, kind="synced-passes", extra=extra, sites=sites, steps=bad)


@detects(Code.COLLECTIVE_MISMATCH)
def unpaired_forward_mismatch(v: View) -> list[Finding]:
    """Ranks that ran DDP's forward in grad mode (gradient sync on) without a backward where other ranks did not:
    typically a rank-0-only evaluation through the DDP wrapper with autograd on. DDP prepares a reduction in such a
    forward and, when it broadcasts buffers, issues a collective the other ranks never issue."""
    if v.world < 2 or not v.steps:
        return []
    most_by, least_by = v.summary.unpaired
    bad = [s for s in range(v.steps) if most_by[s] != least_by[s]]
    if not bad:
        return []
    first = bad[0]
    extra, rest, sites = _apart(v, "unpaired-extra", "unpaired-fewer", "unpaired_sites")
    broadcasts = v.info.buffers_synced
    words = unpaired_words(
        extra=rank_list(extra.ranks, more=extra.more),
        rest=rank_list(rest.ranks, more=rest.more),
        first=first,
        more_forwards=most_by[first],
        sites=sites,
        broadcasts=broadcasts,
        also=bad[1:],
    )
    severity = "error" if broadcasts else "warning"
    return _by_mechanism(words, kind="forward-without-backward", extra=extra, sites=sites, steps=bad, severity=severity)


@detects(Code.COLLECTIVE_MISMATCH)
def eval_broadcast_mismatch(v: View) -> list[Finding]:
    """Ranks whose DDP forwards without grad broadcast the buffers where the other ranks' did not: typically a
    rank-0-only evaluation through the DDP wrapper under torch.no_grad() of a model with buffers (BatchNorm).

    DDP broadcasts at every forward that follows a synced forward in grad mode, whatever the grad mode of its own,
    and skips the broadcast at the forward after one without grad: the evaluation takes over rank 0's broadcast
    from its next training forward, and the other ranks pair it with whatever collective they issue next. Steps
    where `unpaired_forward_mismatch` fires are its to explain (the exchange leaves them out).
    """
    if v.world < 2 or not v.steps:
        return []
    (hi, lo), (u_hi, u_lo) = v.summary.broadcasts, v.summary.unpaired
    bad = [s for s in range(v.steps) if int(hi[s, 1]) != int(lo[s, 1]) and u_hi[s] == u_lo[s]]
    if not bad:
        return []
    first = bad[0]
    extra, rest, sites = _apart(v, "broadcast-extra", "broadcast-fewer", "broadcast_sites")
    words = broadcast_words(
        extra=rank_list(extra.ranks, more=extra.more),
        rest=rank_list(rest.ranks, more=rest.more),
        first=first,
        sites=sites,
        uneven=[s for s in bad if int(hi[s, 0]) != int(lo[s, 0])],
        also=bad[1:],
    )
    return _by_mechanism(words, kind="broadcast-without-grad", extra=extra, sites=sites, steps=bad)


def followed_apart(s: FollowSummary) -> list[Finding]:
    """`collective-mismatch` at the epoch end the check followed: the ranks' counts of the script's collectives,
    DDP's buffer broadcasts or its synced backward passes differed, or some ranks broadcast DDP's buffers from a
    forward without grad that the others did not run (the counts alike: DDP then skips that rank's next one)."""
    if s.lone_broadcasts and s.more_ranks:
        words = lone_broadcast_words(ranks=s.more_ranks, extra_sites=s.extra_sites)
        kind = {"kind": "broadcast-without-grad"}
        return [Finding(code=Code.COLLECTIVE_MISMATCH, severity="error", **words, ranks=s.more_ranks, labels=kind)]
    differ = {k: v for k, v in s.counts.items() if v[0] != v[1]}
    if not differ:
        return []
    words = followed_words(differ=differ, ranks=s.more_ranks, extra_sites=s.extra_sites)
    kind = {"kind": "epoch-end-counts"}
    return [Finding(code=Code.COLLECTIVE_MISMATCH, severity="error", **words, ranks=s.more_ranks, labels=kind)]


def dumps_apart(
    group: str,
    seq: int,
    kinds: dict[tuple[str, Any], list[int]],
    seqs: dict[int, dict[int, FrEntry]],
    dumps: dict[int, FrDump],
) -> Finding:
    """`collective-mismatch` from Flight Recorder dumps: at sequence number `seq` of `group`, the ranks in each of
    `kinds` issued that op and size (or none)."""
    sides = [
        (ranks, None, max(max(seqs[r]) for r in ranks)) if op == "none" else (ranks, seqs[ranks[0]][seq], 0)
        for (op, _), ranks in sorted(kinds.items(), key=lambda kv: (kv[0][0] == "none", kv[1]))
    ]
    name = "the default group" if group == "0" else f"process group {group}"
    members = next((d.group_ranks.get(group) for d in dumps.values() if d.group_ranks.get(group)), [])
    words = dumps_words(
        name=name,
        seq=seq,
        sides=sides,
        dumped=sorted(dumps),
        missing=[r for r in members if r not in dumps],
        start=max(min(s) for s in seqs.values()),
    )
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        **words,
        ranks=sorted(r for ranks in kinds.values() for r in ranks),
        labels={"kind": "sequence", "source": "flight-recorder"},
    )


def beacons_apart(states: dict[int, RankState], parting: Parting) -> Finding:
    """`collective-mismatch` of a failed run, at `parting`."""
    first, behind, different = parting.first, parting.behind, parting.different
    c = first.collective
    culprits = sorted({s.rank for s in (*behind, *different)})
    signals = [f"rank {s.rank} died of {s.signal}" for s in states.values() if s.signal in ("SIGABRT", "SIGSEGV")]
    words = beacons_words(
        first=first,
        behind=behind,
        different=different,
        culprits=culprits,
        signals=signals,
        earlier=parting.earlier,
        sent=parting.sent,
    )
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        **words,
        ranks=sorted({first.rank, *culprits}),
        steps=sorted({max(s.step, 0) for s in (first, *behind, *different)}),
        sites=lines_of(
            c.site or "", *(s.collective.site or "" for s in different), *(s.user_frame or "" for s in behind)
        ),
        labels={
            "kind": "sequence",
            "source": "beacons",
            "call": c.describe(),
            **({"ranks_skipped": ranks_label(s.rank for s in behind)} if behind else {}),
            **({"ranks_other_call": ranks_label(s.rank for s in different)} if different else {}),
            **({"other_call": different[0].collective.describe()} if different and different[0].collective else {}),
        },
        positions=positions(states, [first.rank, *culprits]),
    )
