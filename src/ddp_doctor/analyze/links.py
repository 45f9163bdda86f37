"""Which findings of one report are consequences of which: one mistake in a script reads as one problem.

A parameter that never reaches the loss under default flags leaves DDP's reduction unfinished (`reduction-error`),
so the step's gradients were never all-reduced (`grads-not-synced`), so the replicas drift (`replica-divergence`):
four findings, one cause. The links are decided from the findings' codes and parameters only (never from their
words), conservatively: a consequence is linked only to a cause of a kind that produces it and that the report has,
and a crash only to a cause that names the same parameters. Every finding stays in the report and counts for
`--fail-on`; the renderers show the consequences under their cause (`Finding.caused_by`, `by_cause`).
"""

from __future__ import annotations

from ddp_doctor.analyze.causes import CAUSES
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding

__all__ = ["DIVERGENCE_CAUSES", "UNSYNCED", "cause_fix", "divergence_fix", "link_causes", "ruled_out"]

UNSYNCED = (
    Code.PARAM_SHAPES_DIFFER,
    Code.UNREGISTERED_PARAMETERS,
    Code.WRAPPER_BYPASS,
    Code.UNUSED_PARAMETERS,
    Code.GRAD_BLOCKED,
    Code.REDUCTION_ERROR,
    Code.FROZEN_AFTER_WRAP,
    Code.UNFROZEN_AFTER_WRAP,
    Code.RANK_DEPENDENT_GRAPH,
    Code.DYNAMIC_GRAPH,
    Code.STATIC_GRAPH_UNSAFE,
    Code.COLLECTIVE_MISMATCH,
    Code.GRAD_SCALER_MISMATCH,
)
"""What leaves a step's gradients unreduced (or reduced differently) on some ranks: the causes a `grads-not-synced`
is linked to, and whose presence its fix and `replica-divergence`'s point to (`analyze/agreement.py`, `analyze/replica_state.py`)."""
DIVERGENCE_CAUSES = (*UNSYNCED, *CAUSES, Code.GRADS_NOT_SYNCED)
"""What explains replicas whose weights drift: the codes a weights' `replica-divergence` is linked to, whichever the
parallelism (the modes apart are a cause of their own)."""
_MISSING_GRADIENTS = (
    Code.UNREGISTERED_PARAMETERS,
    Code.UNUSED_PARAMETERS,
    Code.GRAD_BLOCKED,
    Code.FROZEN_AFTER_WRAP,
    Code.DYNAMIC_GRAPH,
    Code.RANK_DEPENDENT_GRAPH,
    Code.STATIC_GRAPH_UNSAFE,
)
"""What leaves DDP waiting for gradients that never come: its reduction error names the same parameters."""
_PARTED = (
    Code.COLLECTIVE_MISMATCH,
    Code.UNEVEN_INPUTS,
    Code.STATE_GATHER_SOME_RANKS,
    Code.SHARDED_FORWARD_SOME_RANKS,
    Code.SHARDED_CHECKPOINT_INCOMPLETE,
    Code.OPTIMIZER_STEP_SKIPPED,
)
"""What puts the ranks' collectives out of step in a run that failed (`analyze/failures.py` names the one that came
first): a rank aborted by the communication library there, or one that lost its peer, is its consequence."""


def _causes_of(f: Finding, by_code: dict[str, list[Finding]]) -> list[str]:
    names = set(f.param_names)
    if f.code == Code.REDUCTION_ERROR:
        return [c for c in _MISSING_GRADIENTS for g in by_code.get(c, [])[:1] if names & set(g.param_names)]
    if f.code == Code.GRADS_NOT_SYNCED:
        return [c for c in UNSYNCED if c in by_code]
    if f.code == Code.REPLICA_DIVERGENCE and f.params:
        # The weights that drift (not the modes: those are a cause of their own).
        return [c for c in DIVERGENCE_CAUSES if c in by_code]
    if f.code == Code.RANK_CRASHED and f.labels.get("signal") in ("SIGABRT", "SIGSEGV"):
        # A rank the communication library aborted on collectives out of step (gloo: SIGABRT).
        parted = next((by_code[c][0] for c in _PARTED if c in by_code), None)
        return [parted.code] if parted is not None and set(f.ranks) <= set(parted.ranks) else []
    if f.code == Code.IDENTICAL_INPUTS_ACROSS_RANKS and Code.SHARDS_OVERLAP in by_code:
        # Samplers that all read the same share (num_replicas=1, or one rank for all) hand out the same batches.
        return [Code.SHARDS_OVERLAP]
    if f.code == Code.UNUSED_PARAMETERS and Code.UNREGISTERED_PARAMETERS in by_code:
        return (
            [Code.UNREGISTERED_PARAMETERS] if names & set(by_code[Code.UNREGISTERED_PARAMETERS][0].param_names) else []
        )
    return []


def link_causes(findings: list[Finding]) -> None:
    """Set each finding's `caused_by` to the codes of the report's findings that explain it, and its `explains` to
    the codes of those it explains (in place)."""
    by_code: dict[str, list[Finding]] = {}
    for f in findings:
        by_code.setdefault(f.code, []).append(f)
    # A problem is never shown under a cause that is only an info (a warning that post-local SGD's replicas are
    # never averaged reads on its own, not under the info that says its gradients differ by design).
    info_only = {code for code, found in by_code.items() if all(g.severity == "info" for g in found)}
    for f in findings:
        causes = dict.fromkeys(_causes_of(f, by_code))
        f.caused_by = [str(c) for c in causes if c != f.code and (c not in info_only or f.severity == "info")]
    for f in findings:
        f.explains = list(dict.fromkeys(g.code for g in findings if f.code in g.caused_by))


_RESTART = "Restart from a checkpoint saved before the divergence, or re-broadcast rank 0's weights knowingly."


def _agreed(measured: dict[str, int]) -> str:
    """When the gradients were compared across the ranks, in words: what was measured, no more."""
    if measured.get("step") and measured.get("closure"):
        at = "and when optimizer.step() used them (at its start, or when a closure-based step returned)"
    elif measured.get("step"):
        at = "and when optimizer.step() began"
    elif measured.get("closure"):
        at = "and when optimizer.step() returned (its closure ran the backward inside it)"
    else:
        return "the gradients agreed after DDP's all-reduce at every step observed (no optimizer step was seen)"
    return f"the gradients agreed after DDP's all-reduce {at}, at every step observed"


def ruled_out(found: frozenset[str]) -> list[str]:
    """The causes of a `replica-divergence` the check looked for and did not see, when nothing found explains it
    (`divergence_fix` says the same in words): the finding's `ruled_out`."""
    if Code.GRADS_NOT_SYNCED in found or found.intersection(CAUSES) or found.intersection(UNSYNCED):
        return []
    return [str(c) for c in CAUSES]


def cause_fix(causes: list[str]) -> str:
    """The fix of replicas apart that the findings of `causes` explain: theirs, then a restart."""
    those = "that finding" if len(causes) == 1 else "those findings"
    return f"fix the cause: {', '.join(causes)} (see {those}). Then {_RESTART[0].lower()}{_RESTART[1:]}"


def divergence_fix(found: frozenset[str], measured: dict[str, int]) -> str:
    """What to do about replicas that differ: fix what the other findings name; when none of them explains it,
    say what was measured and which causes were looked for and not seen."""
    if Code.GRADS_NOT_SYNCED in found:
        return f"fix the cause (see grads-not-synced and the findings that explain it); {_RESTART[0].lower()}{_RESTART[1:]}"
    causes = [c for c in CAUSES if c in found]
    if causes:
        return cause_fix(causes)
    agreed = _agreed(measured)
    if found.intersection(UNSYNCED):
        return (
            f"fix the cause named by the other findings; {agreed}, so the updates themselves differed (an extra "
            "synced pass on one rank, a rank-dependent optimizer setting, or weights changed outside the "
            f"optimizer). {_RESTART}"
        )
    return (
        f"the cause is unknown. {agreed[0].upper()}{agreed[1:]}, and none of the causes ddp-doctor looks for was "
        "seen: no gradients changed on some ranks after DDP's all-reduce (grads-changed-after-sync), the same "
        "optimizer settings on every rank at the steps observed (optimizer-differs), the same optimizer steps "
        "taken in lockstep (optimizer-step-skipped), identical replicas before the first step "
        "(replicas-differ-at-wrap), no write to the weights outside the optimizer on some ranks only, nor one on "
        "every rank after which they parted (weights-changed-outside-optimizer). Look for what changes the weights per rank that these do not cover "
        f"(an optimizer the check did not observe, a parameter replaced rather than written in place). {_RESTART}"
    )
