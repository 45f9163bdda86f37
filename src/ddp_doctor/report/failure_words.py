"""The words of the findings of a run that failed, from their evidence: where each rank was (`Finding.positions`,
in words by `core.whereabouts.said`), the ranks at fault, what the communication library said
(`ddp_doctor.report.words`)."""

from __future__ import annotations

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import rank_list, ranks_of_label
from ddp_doctor.core.whereabouts import Position, capped, said, short
from ddp_doctor.report.wording import flag, measure, value_of, words

__all__: list[str] = []

_SIGNAL_CAUSE = {
    "SIGKILL": "SIGKILL can only come from outside the process: the kernel's out-of-memory killer, a scheduler, "
    "or a person",
    "SIGSEGV": "a segmentation fault inside native code (torch, a CUDA or communication library, or an extension)",
    "SIGABRT": "an abort from native code (gloo and NCCL abort the process on a broken collective)",
    "SIGBUS": "a bus error, usually shared memory (/dev/shm) running out under DataLoader workers",
    "SIGFPE": "a floating-point exception in native code",
    "SIGILL": "an illegal instruction in native code (a build for another CPU)",
    "SIGTERM": "SIGTERM from outside the run",
}
_TEARDOWN_CAUSE = (
    "native code failed after the script had destroyed its process group, with no collective left to break: in "
    "the teardown, not in training (torch's gloo can abort a process there: terminate called without an active "
    "exception)"
)


def _own(f: Finding) -> list[Position]:
    """The positions of the finding's own ranks (those it is about), in rank order."""
    return [p for p in f.positions if p.rank in set(f.ranks)]


def _others(f: Finding) -> str:
    """Where the other ranks were: the positions beside the finding's own (`analyze.positions.beside`), the rest
    counted from measured `other_ranks`; ``""`` where there were none."""
    rest = [p for p in f.positions if p.rank not in set(f.ranks)]
    parts = [f"rank {p.rank} {'lost its peer' if p.lost_peer else 'was'} at {said(p)}" for p in rest]
    return capped(parts, more=int(measure(f, "other_ranks") or 0) - len(rest))


def _site(f: Finding) -> str:
    return f.labels.get("site") or "an unknown place"


@words(Code.RANK_HUNG)
def _rank_hung(f: Finding) -> tuple[str, str]:
    """`ranks`: those furthest behind; `positions`: the first of the ranks still running, in rank order; measured
    `ranks_waiting` (how many still ran); labels `timed_out` (``"True"`` where the check's own timeout ended the
    run), `other_node_ranks` (ranks another node's report covers) and `native` (the communication library's
    line)."""
    waiting = int(value_of(f, "ranks_waiting"))
    shown = capped([f"rank {p.rank} was at {said(p)}" for p in f.positions], more=waiting - len(f.positions))
    elsewhere = ranks_of_label(f.labels.get("other_node_ranks"))
    detail = (
        shown
        + "."
        + (" The ranks ahead were waiting for the ones behind in a collective." if len(f.ranks) < waiting else "")
        + (f" {rank_list(elsewhere)} ran on another node; that node's report covers them." if elsewhere else "")
        + (f" The communication library said: {f.labels['native']}" if f.labels.get("native") else "")
    )
    title = f"{rank_list(f.ranks)} stopped making progress" + (" before the timeout" if flag(f, "timed_out") else "")
    return title, detail


@words(Code.RANK_EXITED)
def _rank_exited(f: Finding) -> tuple[str, str]:
    """`ranks`: the rank that left; measured `exit_status` and `other_ranks`; labels `site` and `phase` (where it
    left from), `trained_on` (the ranks that went on, where any did); `positions`: its own, then the others'."""
    trained_on = ranks_of_label(f.labels.get("trained_on"))
    title = (
        f"rank {f.ranks[0]} exited (status {int(value_of(f, 'exit_status'))}) at step {f.steps[0]}; "
        f"{rank_list(trained_on) if trained_on else 'the others'} trained on"
    )
    waiting = _others(f)
    detail = (
        f"It left from {_site(f)} ({f.labels.get('phase', '')}). A rank that leaves early makes the others wait for "
        "it in their next collective (DDP's gradient all-reduce) until it fails or times out."
        + (f" The others: {waiting}." if waiting else "")
    )
    return title, detail


@words(Code.RANK_CRASHED)
def _rank_crashed(f: Finding) -> tuple[str, str]:
    """By `kind`: `raised` (labels `exception`, `message`; `positions`: the raising ranks', then the others'),
    `signal` and `teardown` (labels `signal`, `fault_frame`; `sites`: the user's line in the fault dump; measured
    `position_age`; label `native`), `exited` (measured `exit_status`; labels `site`, `phase`), `silent`; each
    with measured `other_ranks` where it says what the others did. Label `exchanged` (``"True"``): the ranks'
    loops ended on this error and the ranks still exchanged their records (labels `message` and `site`,
    `every_rank`)."""
    kind = f.labels["kind"]
    step = f.steps[0] if f.steps else 0
    if flag(f, "exchanged"):
        return _ended_the_loop(f, kind == "exited", step)
    if kind == "raised":
        own = _own(f)
        waiting = _others(f)
        title = f"{rank_list(f.ranks)} crashed at step {step}: {f.labels['exception']}: {f.labels['message']}"
        at = own[0].site if own and own[0].site else "an unknown place"
        detail = f"Raised at {at} ({own[0].phase if own else ''}); its traceback was printed above." + (
            f" The other ranks were stopped while waiting for it: {waiting}." if waiting else ""
        )
        return title, detail
    if kind in ("signal", "teardown"):
        return _killed(f, kind == "teardown", step)
    if kind == "exited":
        title = f"{rank_list(f.ranks)} exited with status {int(value_of(f, 'exit_status'))} at step {step}"
        detail = (
            f"The script's own exit with a failure status, at {_site(f)} ({f.labels.get('phase', '')})"
            + (" on every rank" if flag(f, "every_rank") else "")
            + ": torchrun reports the job as failed."
        )
        return title, detail
    own = _own(f)
    waiting = _others(f)
    title = f"{rank_list(f.ranks)} died without a Python error"
    detail = (
        "It ended without an exception, exit status or fault record, at "
        + capped([f"rank {p.rank}: {said(p)}" for p in own], more=len(f.ranks) - len(own))
        + (f". The others: {waiting}." if waiting else ".")
    )
    return title, detail


def _killed(f: Finding, torn: bool, step: int) -> tuple[str, str]:
    """A rank a signal ended: `positions[0]` is its own."""
    sig = f.labels["signal"]
    frame = f.labels.get("fault_frame")
    place = f" in {frame}" + (f" at {f.sites[0]}" if f.sites else "") if frame else f" at step {step}"
    age = measure(f, "position_age")
    exact = "" if age is None else f" (its last published position, {age:.1f} s before the end)"
    cause = _TEARDOWN_CAUSE if torn else _SIGNAL_CAUSE.get(sig, f"signal {sig}")
    rest = _others(f)
    detail = (
        f"It was at {said(f.positions[0])}{exact}. Cause: {cause}."
        + (f" The communication library said: {f.labels['native']}" if f.labels.get("native") else "")
        + (f" The others: {rest}." if rest else "")
    )
    return f"rank {f.ranks[0]} died of {sig}{place}", detail


def _ended_the_loop(f: Finding, exited: bool, step: int) -> tuple[str, str]:
    """The script's own error or failing exit that ended every rank's loop in the same step, after which the ranks
    still exchanged their records: the steps before it were compared."""
    title = f"{rank_list(f.ranks)} {'exited' if exited else 'raised'} at step {step}: " + (
        f.labels.get("message") or "an exception"
    )
    detail = (
        (
            "The script's own sys.exit with a failure status ended the loop at "
            if exited
            else "The script's own error ended the loop at "
        )
        + _site(f)
        + (" on every rank" if flag(f, "every_rank") else "")
        + (
            f"; the comparisons below cover the {step} step(s) before it."
            if step
            else ", before any step closed: no step was compared."
        )
        + (" torchrun reports the job as failed." if exited else " The job fails here without the doctor too.")
    )
    return title, detail


def _seconds(x: float) -> str:
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s" if x < 10 else f"{x:.0f} s"


@words(Code.TIMEOUT_RISK)
def _timeout_risk(f: Finding) -> tuple[str, str]:
    """Two kinds. A run the group's timeout ended (label `waited`): the ranks that timed out waiting, the error
    they raised (labels `exception`, `message`), `positions` (the first of them, then the first 4 that worked
    alone: `ranks`), measured `group_timeout` where the error says it. A span found while following (labels
    `start`, `end`, `passes`): measured `alone`, `alone_projected` (at the loaders' real lengths, where known),
    `group_timeout`; `ranks[0]` worked alone."""
    timeout = measure(f, "group_timeout")
    if "waited" in f.labels:
        after = f" after {timeout:g} s" if timeout is not None else ""
        first, away = f.positions[0], f.positions[1:]
        title = (
            f"{rank_list(ranks_of_label(f.labels['waited']))} timed out{after} in a collective, waiting for "
            f"{rank_list(f.ranks)}, which worked alone"
        )
        detail = (
            f"Rank {first.rank} waited in a collective at {first.site or 'an unknown place'} (step {first.step}, "
            f"{first.phase}) until the process group's timeout ran out{after} ({f.labels['exception']}: "
            f"{f.labels['message']}). "
            + "; ".join(f"Rank {p.rank} was not in any collective: {said(p)}" for p in away)
            + ". It worked alone that long while the others waited for it."
        )
        return title, detail
    alone, projected = value_of(f, "alone"), measure(f, "alone_projected")
    timeout = value_of(f, "group_timeout")
    start, end, passes = f.labels["start"], f.labels["end"], f.labels.get("passes")
    projection = (
        f"about {_seconds(projected)} at the loaders' real lengths"
        if projected is not None
        else "the projection to the real lengths is unknown (a loader without len())"
    )
    reaches = (projected if projected is not None else alone) >= timeout
    title = (
        f"rank {f.ranks[0]} works alone for {projection if projected is not None else _seconds(alone)} while the "
        f"others wait; the process group's timeout is {_seconds(timeout)}"
    )
    detail = (
        f"Between {start} and {end}, rank {f.ranks[0]} worked alone for {_seconds(alone)} as measured with capped "
        f"loaders ({projection}) while every other rank waited for it in {end}."
        + (f" Capped DataLoader passes in that span: {passes}." if passes else "")
        + " "
        + (
            f"That reaches the process group's timeout of {_seconds(timeout)}: in the real run the waiting ranks' "
            "collective times out at this point (gloo raises a timeout error; NCCL's watchdog aborts the job)."
            if reaches
            else f"That is more than half of the process group's timeout of {_seconds(timeout)}: a slower "
            "machine, a bigger evaluation set or a busy file system takes it over the timeout."
        )
    )
    return title, detail


@words(Code.STATE_GATHER_SOME_RANKS)
def _state_gather_some_ranks(f: Finding) -> tuple[str, str]:
    """Labels `call` (the gather), `site` (its line), `ranks_alone` (the ranks that gathered; `ranks` holds every
    rank), `native` (the communication library's line); `positions`: the gathering ranks', then the others'."""
    alone = ranks_of_label(f.labels["ranks_alone"])
    rest = [r for r in f.ranks if r not in alone]
    went = [p for p in f.positions if p.rank in set(rest)]
    call, site = f.labels["call"], f.labels.get("site")
    title = f"{rank_list(alone)} gathered the full state dict alone: {call} at {short(site)}"
    detail = (
        f"{call} at {site or 'an unknown place'} all-gathers every sharded parameter, a collective each rank must "
        f"enter, and {rank_list(rest)} never did: "
        + capped([f"rank {p.rank} went on to {said(p)}" for p in went], more=len(rest) - len(went))
        + ". Their next collectives (a forward's all-gathers of the sharded parameters) were paired with the "
        "gather's, and a mismatched collective aborts, hangs or exchanges the wrong data, depending on the backend "
        "and the sizes." + (f" The communication library said: {f.labels['native']}" if f.labels.get("native") else "")
    )
    return title, detail
