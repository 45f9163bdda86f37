"""Findings for a run whose ranks could not exchange records: who failed first, how, where, and what the others did.

Pure: the input is the supervisor's `RankState` per rank (the ranks' own files, merged); no torch.distributed.
"""

from __future__ import annotations

import re

from ddp_doctor.analyze.epoch_ends import timed_out_waiting
from ddp_doctor.analyze.shapes import shape_findings
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, ParamRef
from ddp_doctor.core.rankfiles import PHASES, ExplainedError, Outcome, RaisedError, RankState
from ddp_doctor.core.ranks import rank_list

__all__ = ["failure_findings", "rank_list"]

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
_DDP_INIT = ("torch/nn/parallel/distributed.py", "__init__")
_SHOWN = 8
"""Ranks described one by one in a finding's text; the rest are counted (a 1,024-rank job stays readable)."""


def _capped(parts: list[str]) -> str:
    """``part; part; ...`` for the first `_SHOWN` parts, then ``and N other ranks``."""
    more = len(parts) - _SHOWN
    return "; ".join(parts[:_SHOWN]) + (f"; and {more} other rank{'s' if more > 1 else ''}" if more > 0 else "")


def _where(s: RankState) -> str:
    if s.raised is not None:
        # A crashed rank's own record is exact; its last sample may show the doctor's exit path.
        return f"step {max(s.raised.step, 0)}, {s.raised.phase}, at {s.raised.site or 'an unknown place'}"
    step = max(s.step, 0)
    if s.in_collective and s.collective is not None:
        c = s.collective
        return f"step {step}, {s.phase}, inside {c.describe()} called at {c.site or 'an unknown place'}"
    waiting = ", in DDP's backward (its gradient all-reduce)" if s.phase == "backward" else ""
    # The watchdog's sample of the user's line is newer than the last phase change only when the rank sat still
    # (a hang); otherwise the line published at the last phase change is the better one.
    sample_newer = s.user_frame is not None and (
        s.site is None
        or s.position_age_s is None
        or (s.sample_age_s is not None and s.sample_age_s <= s.position_age_s)
    )
    if sample_newer:
        age = f" (sampled; there for the last {s.sample_age_s:.1f} s)" if s.sample_age_s and s.sample_age_s > 1 else ""
        return f"step {step}, {s.phase}{waiting}, at {s.user_frame}{age}"
    if s.site:
        return f"step {step}, {s.phase}{waiting}, after {s.site}"
    return f"step {step}, {s.phase}{waiting}, at {s.innermost or 'an unknown place'}"


def _short(site: str | None) -> str:
    return site.rsplit("/", 1)[-1].split()[0] if site else "an unknown place"


def _fault_place(s: RankState) -> str:
    """`in DistributedDataParallel.__init__ at train.py:12` from the fault dump."""
    if s.fault is None or not s.fault.frames:
        return ""
    inner_file, _, inner_fn = s.fault.frames[0]
    if any(inner_file.endswith(_DDP_INIT[0]) and fn == _DDP_INIT[1] for inner_file, _, fn in s.fault.frames[:3]):
        where = "in DistributedDataParallel.__init__"
    else:
        where = f"in {inner_fn} ({inner_file.rsplit('/', 1)[-1]})"
    user = next(
        (
            f"{f}:{n}"
            for f, n, _ in s.fault.frames
            if "/site-packages/" not in f and "/lib/python" not in f and "ddp_doctor" not in f
        ),
        None,
    )
    return where + (f" at {user}" if user else "")


def _mismatch(states: dict[int, RankState]) -> Finding | None:
    """Ranks whose script collectives disagree: one rank waits in a collective another rank never called (or called
    with another op or shape), so the other rank's next collective (often DDP's gradient all-reduce) is paired
    with it. Judged from each rank's last collective and its count of the script's collectives."""
    live = [s for s in states.values() if s.built_ddp]
    waiting = [s for s in live if s.in_collective and s.collective is not None]
    if not waiting or len(live) < 2:
        return None
    first = min(waiting, key=lambda s: (s.collective.n, s.rank))
    c = first.collective
    others = [s for s in live if s.rank != first.rank]
    behind = [s for s in others if s.collectives < c.n]
    # A rank still waiting in, or already past, its collective at the same position with another op or shape
    # (the sender of a broadcast returns at once; the receiver of the wrong size aborts).
    different = [
        s
        for s in others
        if s.collective is not None
        and s.collective.n == c.n
        and (s.collective.op, s.collective.tensor) != (c.op, c.tensor)
    ]
    if not behind and not different:
        return None
    parts = [
        (
            f"rank {first.rank} called {c.describe()} at {c.site or 'an unknown place'} in step {c.step or 0} "
            f"(its collective #{c.n}) and waited there"
        )
    ]
    for s in behind:
        parts.append(
            f"rank {s.rank} never called it: it had issued {s.collectives} of the script's collectives and "
            f"went on to {_where(s)}"
            + (
                "; DDP's next gradient all-reduce on that rank was paired with it"
                if s.phase in ("backward", "after backward") or not s.in_collective
                else ""
            )
        )
    for s in different:
        o = s.collective
        parts.append(f"rank {s.rank} called {o.describe()} at {o.site or 'an unknown place'} at the same position")
    culprits = sorted({s.rank for s in (*behind, *different)})
    signals = [f"rank {s.rank} died of {s.signal}" for s in states.values() if s.signal in ("SIGABRT", "SIGSEGV")]
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        title=(
            f"{rank_list(culprits)} skipped {c.op} ({_short(c.site)}) that rank {first.rank} called"
            if behind and not different
            else f"ranks called different collectives at position {c.n}: {c.describe()} on rank {first.rank}"
        ),
        detail=_capped(parts)
        + "."
        + (f" {_capped(signals)} (gloo aborts a process whose peer issued a different collective)." if signals else ""),
        ranks=sorted({first.rank, *culprits}),
        steps=sorted({max(s.step, 0) for s in (first, *behind, *different)}),
        fix=(
            f"give {c.op} at {c.site or 'that line'} the same dtype and shape on every rank: agree on the size "
            "first (all_reduce the length, or broadcast_object_list), then pad or slice to it."
            if different and all(s.collective.op == c.op for s in different) and not behind
            else f"make every rank of the group call the same collectives in the same order: move {c.op} at "
            f"{c.site or 'that line'} out of the rank-dependent branch (compute the condition on every rank, "
            f"or all_reduce a flag first), or call it on every rank."
        ),
    )


def _param_refs(explained: ExplainedError) -> list[ParamRef]:
    """The parameters a rank's explained DDP error names, with their sizes (0 where the rank file has none)."""
    names = list(explained.params)
    numels = explained.numels or [0] * len(names)
    return [ParamRef(n, k) for n, k in zip(names, numels)]


def _trained_elsewhere(states: dict[int, RankState], rank: int, crash: RaisedError) -> Finding | None:
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
        title=f"{len(names)} parameter(s) got a gradient on {rank_list(trained)} but not on rank {rank} in step "
        f"{previous}",
        detail=f"Rank {rank} failed at the start of step {crash.step} because these parameters got no gradient in "
        f"step {previous}; {rank_list(trained)} closed that step with a gradient for every one of them (then "
        f"waited for rank {rank} in a collective). The set "
        "of parameters that reach the loss depends on the rank: a branch on the rank, or a task only some "
        "ranks have data for. With default flags DDP cannot reduce such a set.",
        params=_param_refs(explained),
        ranks=sorted({rank, *trained}),
        steps=[previous],
        fix="keep them trainable; build DDP with static_graph=True when each rank's used set is the same at every "
        "step (cheapest), or find_unused_parameters=True when it changes.",
    )


_RANK_IN_MESSAGE = re.compile(r"^DDP failed on rank \d+:")


def _same_ddp_error(states: dict[int, RankState], causes: dict[int, RankState]) -> list[tuple[list[int], RaisedError]]:
    """Groups of two or more ranks that raised the same explained DDP error (code, step, parameters) and that
    no other rank's record contradicts (`rank-dependent-graph`): one finding for each group, as the exchange's
    joint report gives (every rank of a job usually fails the same way)."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for rank, s in sorted(causes.items()):
        crash = s.raised
        if crash.explained is None or _trained_elsewhere(states, rank, crash) is not None:
            continue
        key = (crash.explained.code, max(crash.step, 0), tuple(crash.explained.params))
        groups.setdefault(key, []).append(rank)
    return [(ranks, causes[ranks[0]].raised) for ranks in groups.values() if len(ranks) > 1]


def failure_findings(states: dict[int, RankState], *, timed_out: bool, native: list[str] = ()) -> list[Finding]:
    """The findings for a run whose ranks did not exchange records. `native`: gloo's or NCCL's own error lines
    found in the job's output (C++ aborts print them; no rank file can)."""
    shapes = shape_findings(states)
    if shapes:
        return shapes  # the refusing rank's error and its peers' lost connections are all this one cause
    ranks = sorted(states)
    crashed = {r: s for r, s in states.items() if s.outcome is Outcome.CRASHED and s.raised is not None}
    causes = {r: s for r, s in crashed.items() if not s.raised.peer_lost}
    exited = {r: s for r, s in states.items() if s.outcome is Outcome.EXITED}
    killed = {r: s for r, s in states.items() if s.outcome is None and s.signal not in (None, "SIGTERM")}
    findings: list[Finding] = []

    def others(culprits: list[int]) -> str:
        parts = []
        for r in ranks:
            if r in culprits:
                continue
            s = states[r]
            if r in crashed:
                c = s.raised
                parts.append(
                    f"rank {r} lost its peer at step {max(c.step, 0)}, {c.phase}, at {c.site or 'an unknown place'}"
                )
            elif s.outcome is None and not s.ended:
                parts.append(f"rank {r} was at {_where(s)}")
        return _capped(parts)

    mismatch = _mismatch(states)
    if mismatch is not None:
        findings.append(mismatch)

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
                fix="fix the cause named above, then run the check again for the full diagnosis (the ranks could "
                "not exchange their records, so the other checks did not run).",
            )
        )
    alike = {r for ranks_alike, _ in joint for r in ranks_alike}
    for rank, s in sorted(causes.items()):
        if rank in alike:
            continue
        crash = s.raised
        step = max(crash.step, 0)
        waiting = others(list(causes))
        if crash.explained:
            trained = _trained_elsewhere(states, rank, crash)
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
                        "keep them trainable (see rank-dependent-graph): build DDP with static_graph=True if each rank's "
                        "set is the same at every step, else with find_unused_parameters=True."
                        if trained
                        else "fix the cause named above, then run the check again for the full diagnosis (the ranks could "
                        "not exchange their records, so the other checks did not run)."
                    ),
                )
            )
            continue
        findings.append(
            Finding(
                code=Code.RANK_CRASHED,
                severity="error",
                title=f"rank {rank} crashed at step {step}: {crash.type}: {crash.message[:200]}",
                detail=(
                    f"Raised at {crash.site or 'an unknown place'} ({crash.phase}); its traceback was printed "
                    "above." + (f" The other ranks were stopped while waiting for it: {waiting}." if waiting else "")
                ),
                ranks=[rank],
                steps=[step],
                fix="fix the error on that rank; the rest of the diagnosis needs every rank to finish its steps.",
            )
        )

    for rank, s in sorted(killed.items()):
        cause = _SIGNAL_CAUSE.get(s.signal or "", f"signal {s.signal}")
        place = _fault_place(s)
        exact = (
            ""
            if s.position_age_s is None
            else f" (its last published position, {s.position_age_s:.1f} s before the end)"
        )
        rest = others([rank, *(mismatch.ranks if mismatch else [])])
        findings.append(
            Finding(
                code=Code.RANK_CRASHED,
                severity="error",
                title=f"rank {rank} died of {s.signal}" + (f" {place}" if place else f" at step {max(s.step, 0)}"),
                detail=(
                    f"It was at {_where(s)}{exact}. Cause: {cause}."
                    + (
                        f" The communication library said: {native[0]}"
                        if native and s.signal in ("SIGABRT", "SIGSEGV")
                        else ""
                    )
                    + (f" The others: {rest}." if rest else "")
                ),
                ranks=[rank],
                steps=[max(s.step, 0)],
                fix=(
                    "run the same script without ddp-doctor to confirm; a segfault in DDP's constructor is known with "
                    "TORCH_DISTRIBUTED_DEBUG=DETAIL on some torch builds: unset it."
                    if s.signal == "SIGSEGV"
                    else "see the collective-mismatch finding."
                    if mismatch is not None and s.signal == "SIGABRT"
                    else "check the system log (dmesg) and the memory use of that rank."
                    if s.signal == "SIGKILL"
                    else "run that rank's command alone to see the native error."
                ),
            )
        )

    if exited and not causes:
        steps_by_rank = {r: max(s.step, 0) for r, s in states.items()}
        for rank, s in sorted(exited.items()):
            still = [r for r in ranks if r not in exited and (states[r].outcome is not Outcome.REPORTED)]
            if not still and len({steps_by_rank[r] for r in exited}) == 1:
                continue  # every rank ended at the same step: the script is just short
            waiting = others([*exited])
            findings.append(
                Finding(
                    code=Code.RANK_EXITED,
                    severity="error",
                    title=f"rank {rank} exited (status {s.exit_status}) at step {steps_by_rank[rank]}; "
                    f"{rank_list(still) if still else 'the others'} trained on",
                    detail=(
                        f"It left from {s.exit_site or 'an unknown place'} ({s.phase}). A rank that leaves early makes "
                        "the others wait for it in their next collective (DDP's gradient all-reduce) until it fails "
                        "or times out." + (f" The others: {waiting}." if waiting else "")
                    ),
                    ranks=[rank],
                    steps=[steps_by_rank[rank]],
                    fix="make every rank take the same decision to stop: compute the stopping condition from values "
                    "reduced across ranks (all_reduce a flag), and give every rank the same number of batches.",
                )
            )

    if not findings and (timeout := timed_out_waiting(states, _where)) is not None:
        findings.append(timeout)
    accounted = set(causes) | set(killed) | set(exited) | set(mismatch.ranks if mismatch else [])
    silent = [r for r in ranks if states[r].outcome is None and r not in accounted and not states[r].ended]
    if not findings and silent and not timed_out:
        findings.append(
            Finding(
                code=Code.RANK_CRASHED,
                severity="error",
                title=f"{rank_list(silent)} died without a Python error",
                detail=(
                    "It ended without an exception, exit status or fault record, at "
                    + _capped([f"rank {r}: {_where(states[r])}" for r in silent])
                    + (f". The others: {others(silent)}." if others(silent) else ".")
                ),
                ranks=silent,
                steps=sorted({max(states[r].step, 0) for r in silent}),
                fix="check the system log (dmesg) and the memory use of that rank.",
            )
        )
    if not findings or (timed_out and mismatch is None and not causes and not killed and not exited):
        hung = _hung(states, timed_out)
        if hung and native:
            hung[0].detail += f" The communication library said: {native[0]}"
        findings.extend(hung)
    return findings


def _hung(states: dict[int, RankState], timed_out: bool) -> list[Finding]:
    waiting = {r: s for r, s in states.items() if s.outcome is None and not s.ended}
    if not waiting:
        return []
    order = {r: (s.step, PHASES.index(s.phase) if s.phase in PHASES else 0) for r, s in waiting.items()}
    behind = min(order.values())
    stuck = sorted(r for r, key in order.items() if key == behind)
    world = max(s.world_size for s in states.values())
    missing = [r for r in range(world) if r not in states]
    return [
        Finding(
            code=Code.RANK_HUNG,
            severity="error",
            title=f"{rank_list(stuck)} stopped making progress" + (" before the timeout" if timed_out else ""),
            detail=(
                _capped([f"rank {r} was at {_where(s)}" for r, s in sorted(waiting.items())])
                + "."
                + (
                    " The ranks ahead were waiting for the ones behind in a collective."
                    if len(stuck) < len(order)
                    else ""
                )
                + (f" {rank_list(missing)} ran on another node; that node's report covers them." if missing else "")
            ),
            ranks=stuck,
            steps=sorted({max(states[r].step, 0) for r in stuck}),
            fix="look at what the stuck rank does at that line: a collective that only some ranks call, a loop with "
            "a different number of iterations per rank, or a data source that blocks.",
        )
    ]
