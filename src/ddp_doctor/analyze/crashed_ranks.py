"""Ranks that raised. In a run whose ranks could not exchange records: DDP's own errors explained (one finding for
the ranks that failed alike, as the exchanged report gives), `rank-dependent-graph` when a rank's reduction error
names parameters another rank trained, and `rank-crashed` for the script's own errors, for a rank a signal ended
and for one that ended with no record at all (pure: reads the supervisor's `RankState` per rank;
`analyze/failures.py` puts these findings in order). In one whose ranks exchanged them after the script's own
error ended every rank's loop in the same step: `rank-crashed` too (`script_raised`, a detector of the `Summary`).
"""

from __future__ import annotations

import re

from ddp_doctor.analyze.positions import beside, capped, fault_frame, fault_site, short, where
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef, lines_of
from ddp_doctor.core.phase import Phase
from ddp_doctor.core.rankfiles import ExplainedError, RaisedError
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.rankstate import RankState

__all__ = [
    "crash_findings",
    "died_silently",
    "exited_failing",
    "init_waited_for",
    "killed_findings",
    "script_raised",
    "trained_elsewhere",
]

_AFTER_STEPS = (Phase.FOLLOWING.value, Phase.WATCHED.value, Phase.TORN_DOWN.value)
"""Where a rank is once its observed steps were diagnosed."""

_RANK_IN_MESSAGE = re.compile(r"^DDP failed on rank \d+:")
_RUN_AGAIN = (
    "fix the cause named above, then run the check again for the full diagnosis (the ranks could not exchange "
    "their records, so the other checks did not run)."
)


def _param_refs(explained: ExplainedError) -> list[ParamRef]:
    """The parameters a rank's explained DDP error names, with their sizes (0 where the rank file has none)."""
    names = list(explained.params)
    numels = explained.numels or [0] * len(names)
    return [ParamRef(n, k) for n, k in zip(names, numels)]


def trained_elsewhere(states: dict[int, RankState], rank: int, crash: RaisedError) -> Finding | None:
    """`rank-dependent-graph` when DDP's reduction error on `rank` names parameters that other ranks trained.

    The error at step S names the parameters that got no gradient on `rank` in step S-1. Another rank that closed
    step S-1 with none of them missing (its beacon says so: it went on, and then waited in a collective for `rank`)
    trained them: the used set depends on the rank.
    """
    explained = crash.explained
    names = list(explained.params) if explained is not None else []
    if explained is None or explained.code != Code.REDUCTION_ERROR or not names or crash.step < 1:
        return None
    previous = crash.step - 1
    trained = [
        r
        for r, s in sorted(states.items())
        if r != rank
        and s.closed is not None
        and s.closed.step == previous
        and len(s.closed.missing) < 16
        and not set(names) & set(s.closed.missing)
    ]
    if not trained:
        return None
    return Finding(
        code=Code.RANK_DEPENDENT_GRAPH,
        severity="error",
        labels={"kind": "crash", "failed_rank": str(rank)},
        params=_param_refs(explained),
        ranks=sorted({rank, *trained}),
        steps=[previous],
        fix="keep them trainable; build DDP with static_graph=True when each rank's used set is the same at every "
        "step (cheapest), or find_unused_parameters=True when it changes.",
    )


def _same_ddp_error(states: dict[int, RankState], causes: dict[int, RankState]) -> list[tuple[list[int], RaisedError]]:
    """Groups of two or more ranks that raised the same explained DDP error (code, step, parameters) and that
    no other rank's record contradicts (`rank-dependent-graph`): one finding for each group, as the exchange's
    joint report gives (every rank of a job usually fails the same way)."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for rank, s in sorted(causes.items()):
        crash = s.raised
        if crash.explained is None or trained_elsewhere(states, rank, crash) is not None:
            continue
        key = (crash.explained.code, max(crash.step, 0), tuple(crash.explained.params))
        groups.setdefault(key, []).append(rank)
    return [(ranks, causes[ranks[0]].raised) for ranks in groups.values() if len(ranks) > 1]


def crash_findings(states: dict[int, RankState], causes: dict[int, RankState]) -> list[Finding]:
    """The findings of the ranks in `causes` (those that raised an error of their own, not a lost peer): the
    ranks that failed alike first, then each other rank in rank order."""
    findings: list[Finding] = []
    joint = _same_ddp_error(states, causes)
    for ranks_alike, crash in joint:
        findings.append(
            Finding(
                code=crash.explained.code,
                severity="error",
                title=f"{rank_list(ranks_alike)}: DDP failed at step {max(crash.step, 0)}",
                detail=_RANK_IN_MESSAGE.sub(f"DDP failed on {rank_list(ranks_alike)}:", crash.explained.message, 1),
                params=_param_refs(crash.explained),
                ranks=ranks_alike,
                steps=[max(crash.step, 0)],
                fix=_RUN_AGAIN,
            )
        )
    alike = {r for ranks_alike, _ in joint for r in ranks_alike}
    # The script's own errors: one finding for the ranks that raised the same error at the same line and step.
    own: dict[tuple[int, str, str, str, str], list[int]] = {}
    for rank, s in sorted(causes.items()):
        if rank in alike:
            continue
        crash = s.raised
        step = max(crash.step, 0)
        if crash.explained:
            trained = trained_elsewhere(states, rank, crash)
            if trained:
                findings.append(trained)
            findings.append(
                Finding(
                    code=crash.explained.code,
                    severity="error",
                    title=f"rank {rank}: DDP failed at step {step}",
                    # The rank's own fix considers freezing; other ranks trained them, so that part is dropped.
                    detail=crash.explained.message.split(" Fix: ")[0] if trained else crash.explained.message,
                    params=_param_refs(crash.explained),
                    ranks=[rank],
                    steps=[step],
                    fix=(
                        "keep them trainable (see rank-dependent-graph): build DDP with static_graph=True if each "
                        "rank's set is the same at every step, else with find_unused_parameters=True."
                        if trained
                        else _RUN_AGAIN
                    ),
                )
            )
            continue
        own.setdefault((step, crash.type, crash.message, crash.site or "", crash.phase), []).append(rank)
    for (step, type_, message, site, phase), ranks in own.items():
        carried, others_count = beside(states, ranks, list(causes))
        findings.append(
            Finding(
                code=Code.RANK_CRASHED,
                severity="error",
                ranks=ranks,
                steps=[step],
                sites=lines_of(site),
                labels={"kind": "raised", "exception": type_, "message": message[:200]},
                measured=[others_count],
                positions=carried,
                fix="fix the error at that line"
                + (
                    "."
                    if phase in _AFTER_STEPS
                    else "; the rest of the diagnosis needs every rank to finish its steps."
                ),
            )
        )
    return findings


def killed_findings(
    states: dict[int, RankState], killed: dict[int, RankState], mismatch: Finding | None, native: list[str]
) -> list[Finding]:
    """`rank-crashed` for each rank a signal ended (`killed`), with the cause the signal tells; `mismatch` (the
    collective the ranks parted at, if named) is what an abort points to, `native` the communication library's own
    error lines."""
    findings = []
    for rank, s in sorted(killed.items()):
        torn = s.phase == Phase.TORN_DOWN.value and s.signal in ("SIGABRT", "SIGSEGV")
        frame = fault_frame(s)
        user = fault_site(s) if frame else None
        carried, others_count = beside(states, [rank], [rank, *(mismatch.ranks if mismatch else [])])
        labels = {"kind": "teardown" if torn else "signal", "signal": s.signal or ""}
        if frame:
            labels["fault_frame"] = frame
        if native and s.signal in ("SIGABRT", "SIGSEGV"):
            labels["native"] = native[0]
        findings.append(
            Finding(
                code=Code.RANK_CRASHED,
                severity="error",
                ranks=[rank],
                steps=[max(s.step, 0)],
                sites=[user] if user else [],
                labels=labels,
                measured=[
                    *([] if s.position_age_s is None else [Measure("position_age", s.position_age_s, "s")]),
                    others_count,
                ],
                positions=carried,
                fix=(
                    "the steps before destroy_process_group() are not affected; check that what the script does "
                    "after it (a final save, an upload) completed, and run the same script without ddp-doctor to see "
                    "the native error."
                    if torn
                    else "run the same script without ddp-doctor to confirm; a segfault in DDP's constructor is known with "
                    "TORCH_DISTRIBUTED_DEBUG=DETAIL on some torch builds: unset it."
                    if s.signal == "SIGSEGV"
                    else f"see the {mismatch.code} finding."
                    if mismatch is not None and s.signal == "SIGABRT"
                    else "check the system log (dmesg) and the memory use of that rank."
                    if s.signal == "SIGKILL"
                    else "run that rank's command alone to see the native error."
                ),
            )
        )

    return findings


def exited_failing(states: dict[int, RankState], exited: dict[int, RankState]) -> list[Finding]:
    """`rank-crashed` for ranks that all left at the same step with a failure status (`sys.exit(1)` on every rank
    after a check of their own): one finding per status and line. Ranks that left with status 0 ended a short
    script."""
    groups: dict[tuple[int, int, str, str], list[int]] = {}
    for rank, s in sorted(exited.items()):
        if s.exit_status and s.phase != Phase.TORN_DOWN.value:
            groups.setdefault((s.exit_status, max(s.step, 0), s.exit_site or "", s.phase), []).append(rank)
    return [
        Finding(
            code=Code.RANK_CRASHED,
            severity="error",
            ranks=ranks,
            steps=[step],
            sites=lines_of(site),
            labels={"kind": "exited", "site": site, "phase": phase, "every_rank": str(len(ranks) == len(states))},
            measured=[Measure("exit_status", status, "value")],
            fix="if the job should go on, find why the script exits there (the condition before that line).",
        )
        for (status, step, site, phase), ranks in groups.items()
    ]


def died_silently(states: dict[int, RankState], silent: list[int]) -> Finding:
    """`rank-crashed` for ranks that ended with no exception, exit status or fault record."""
    carried, others_count = beside(states, silent, silent)
    return Finding(
        code=Code.RANK_CRASHED,
        severity="error",
        ranks=silent,
        steps=sorted({max(states[r].step, 0) for r in silent}),
        labels={"kind": "silent"},
        measured=[others_count],
        positions=carried,
        fix="check the system log (dmesg) and the memory use of that rank.",
    )


_STORE_KEYS = re.compile(r"keys: (.+)$")


def init_waited_for(crashed: RankState, states: dict[int, RankState]) -> str | None:
    """A rank whose `init_process_group` timed out waiting in the store for the other ranks to register (gloo's
    DistStoreError, `keys: /default_pg/0//cpu//0/1`: the last part of each key is the rank it waited for), in the
    words of the ranks that never joined and where they were; None for any other error. The rank that timed out
    only noticed: torchrun names it the root cause. Ground truth in tests/failures/test_init_failures.py."""
    raised = crashed.raised
    if raised is None or raised.type != "DistStoreError" or "init_process_group" not in raised.traceback:
        return None
    match = _STORE_KEYS.search(raised.message)
    missing = sorted(
        {
            int(key.rsplit("/", 1)[1])
            for key in (match.group(1).split(",") if match else [])
            if key.strip()[-1:].isdigit()
        }
    )
    missing = [r for r in missing if r != crashed.rank]
    if not missing:
        return None
    seen = [f"rank {r} was at {where(states[r])}" for r in missing if r in states]
    return (
        f"rank {crashed.rank} timed out in init_process_group at {short(raised.site)} waiting for "
        f"{rank_list(missing)} to join the process group ({raised.type}: {raised.message}), and "
        f"{'it' if len(missing) == 1 else 'they'} never registered with the job's store"
        + (f": {capped(seen)}" if seen else "")
        + ". Look at why: a MASTER_ADDR or MASTER_PORT that differs on that rank, a firewall between the nodes, or "
        "a rank that failed or stalled before init_process_group (its own output says which). The rank that timed "
        "out only noticed; torchrun names it the root cause."
    )


_OWN = ("other", "ddp-other", "exit")
"""The crash kinds that are the script's (or DDP's unexplained) error on this model's loop, or its sys.exit with a
failure status."""


@detects(Code.RANK_CRASHED)
def script_raised(v: View) -> list[Finding]:
    """One finding per distinct error (message and line) the ranks' loops ended with."""
    groups: dict[tuple[str, int, str, str], list[int]] = {}
    counts = 0
    for kind in _OWN:
        examples = v.crashed(kind)
        counts += examples.count
        for r in examples.ranks:
            meta = v.meta(r)
            key = (kind, max(int(meta["crash_step"]), 0), meta["crash_message"], meta.get("crash_site", ""))
            groups.setdefault(key, []).append(r)
    findings = []
    named = sum(len(ranks) for ranks in groups.values())
    for (kind, step, message, site), ranks in groups.items():
        exited = kind == "exit"
        labels = {"kind": "exited" if exited else "raised", "exchanged": "True", "site": site}
        if message:
            labels["message"] = message.splitlines()[0][:200]
        labels["every_rank"] = str(counts == v.world)
        findings.append(
            Finding(
                code=Code.RANK_CRASHED,
                severity="error",
                ranks=sorted(ranks),
                more_ranks=max(counts - named, 0) if len(groups) == 1 else 0,
                steps=[step],
                sites=lines_of(site),
                labels=labels,
                fix=(
                    "if the job should go on, find why the script exits there (the condition before that line); "
                    if exited
                    else "fix the error at that line; "
                )
                + "then run the check again to observe the steps after it.",
            )
        )
    return findings
