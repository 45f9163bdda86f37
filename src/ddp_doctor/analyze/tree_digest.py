"""Which parts of a module tree's state differ across ranks. The ranks compare one digest per step of what their
trees hold beyond DDP's own lists (`StepCounters.state_digest`, `observation/tree_scan.py`): the modules' train/eval
modes, the parameters DDP does not hold, the buffers registered after the wrap, the tensors the optimizer trains
outside the model, the modules run beside it. The digest says at which step the trees first differ, not in what;
rank 0 and the example ranks that differ from it say what they held at the last step, and this module compares
those parts, so that a finding about one part claims the first step only when no other part differs."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.view import View
from ddp_doctor.core.findings import ParamRef

__all__ = ["differing", "modes_parted", "param_entry", "parted_at", "parts_apart", "same_fingerprint", "step_apart"]


def _modes(entry: dict[str, Any] | None) -> tuple[bool, int, tuple[str, ...]] | None:
    if entry is None:
        return None
    return bool(entry["training"]), int(entry["other_mode_count"]), tuple(entry["other_mode"])


def differing(v: View) -> tuple[list[int], bool]:
    """(the example ranks whose tree differs from rank 0's at some step, whether their modes differ from its at the
    first step the trees differ: then the modes parted there)."""
    if v.summary.state_step is None:
        return [], False
    odd = v.ranks("state-differs").ranks
    ref = v.meta(0).get("state")
    return odd, any(_modes(v.meta(r).get("state")) != _modes(ref) for r in odd)


def modes_parted(v: View) -> tuple[int, dict[int, dict[str, Any]]] | None:
    """The first step at which the example ranks' train/eval modes differ from rank 0's, with the state entry each
    held then: the trees' first differing step when the modes differ there, else the first later change the ranks'
    state logs show (their first entries) after which they differ; None when they agree throughout."""
    odd, modes = differing(v)
    if modes:
        return v.summary.state_step, {r: v.meta(r).get("state") or {} for r in [0, *odd]}
    logs = {r: v.meta(r).get("state_log") or [] for r in [0, *odd]}
    for step in sorted({e["step"] for log in logs.values() for e in log}):
        held = {r: next((e for e in reversed(log) if e["step"] <= step), None) for r, log in logs.items()}
        if any(_modes(held[r]) != _modes(held[0]) for r in odd):
            return step, {r: e or {} for r, e in held.items()}
    return None


_FINGERPRINTED = ("unregistered", "late_buffers", "outside", "beside_modules")
"""The parts of the tree's state digest whose entries carry fingerprints (`fp`) at the last observed step: the
trainable parameters DDP does not hold, the buffers registered after the wrap, the tensors the optimizer trains
outside the model, the modules run beside it."""


def parts_apart(v: View) -> set[str]:
    """Which parts of the tree's state digest may explain its first difference between rank 0 and the example
    ranks whose digest differs: `"modes"` when the modes differ at that step, and each part of `_FINGERPRINTED`
    whose fingerprints differ at the last observed step (an entry one rank has and another lacks counts as apart)."""
    odd, modes = differing(v)
    apart = {"modes"} if modes else set()
    for part in _FINGERPRINTED:
        mine = {e["name"]: e.get("fp") for e in v.meta(0).get(part) or []}
        for r in odd:
            theirs = {e["name"]: e.get("fp") for e in v.meta(r).get(part) or []}
            if mine.keys() != theirs.keys() or any(not same_fingerprint(fp, theirs[n]) for n, fp in mine.items()):
                apart.add(part)
    return apart


def parted_at(v: View, part: str) -> int | None:
    """The first observed step at which `part` of the tree's state (`_FINGERPRINTED`) differed across ranks, where
    that is known: the digest's first differing step, when nothing else it covers differs (at the last step). None
    when other parts differ too: the digest cannot tell which parted first."""
    return v.summary.state_step if parts_apart(v) == {part} else None


def step_apart(v: View, part: str) -> tuple[int, bool]:
    """The step to name for `part` of the tree's state differing across ranks, and whether it is the first: the
    first step where that is known (`parted_at`), else the last observed step."""
    parted = parted_at(v, part)
    return (v.steps - 1, False) if parted is None else (parted, True)


def same_fingerprint(a: list[float] | None, b: list[float] | None) -> bool:
    """Two fingerprints alike (NaN equal to NaN; a missing one alike only to another missing one)."""
    if a is None or b is None:
        return a is b
    return all(x == y or (x != x and y != y) for x, y in zip(a, b))


def param_entry(entry: dict[str, Any]) -> ParamRef:
    """A `ParamRef` of a logged tensor's `name` and `shape` (None for a lazy module's parameter: size 0, no shape)."""
    if entry["shape"] is None:
        return ParamRef(entry["name"], 0, ())
    shape = tuple(entry["shape"])
    numel = 1
    for d in shape:
        numel *= d
    return ParamRef(entry["name"], numel, shape)
