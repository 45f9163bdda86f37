"""Finding builders shared by `analyze` and `guard`: each code's severity rule and core wording live here once, so a
report and a guard cannot disagree about the same problem. Pure: no communication, nothing read from the process.

Callers add what only they know: where the problem was seen (`note`), the steps and ranks, and the fix in the words
of the framework that built DDP.
"""

from __future__ import annotations

from ddp_doctor.report.model import Finding, ParamRef

__all__ = ["buffer_divergence", "count", "frozen_after_wrap", "replica_divergence", "unfrozen_after_wrap",
           "wrapper_bypass"]


def count(n: int, word: str) -> str:
    """``"1 parameter"``, ``"3 parameters"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def frozen_after_wrap(*, params: list[ParamRef], ranks: list[int], steps: list[int], find_unused: bool,
                      static_graph: bool, fix: str, note: str = "") -> Finding:
    """Parameters whose `requires_grad` went from True to False after DDP was built.

    Severity: ``error`` with default flags (the step's reduction never finishes), ``warning`` otherwise.
    """
    default_flags = not find_unused and not static_graph
    detail = ("requires_grad was set to False after DDP was built. DDP's reducer still expects their gradients: "
              + ("with default flags the step's reduction never finishes and the next step fails."
                 if default_flags else "they are still all-reduced every step, which wastes communication."))
    return Finding(
        code="frozen-after-wrap", severity="error" if default_flags else "warning",
        title=f"{count(len(params), 'parameter')} frozen after DDP was built",
        detail=detail + note, params=params, ranks=ranks, steps=steps, fix=fix)


def unfrozen_after_wrap(*, params: list[ParamRef], ranks: list[int], steps: list[int], fix: str,
                        note: str = "") -> Finding:
    """Parameters whose `requires_grad` went from False to True after DDP was built. Always an ``error``: nothing
    ever all-reduces their gradients."""
    return Finding(
        code="unfrozen-after-wrap", severity="error",
        title=f"{count(len(params), 'parameter')} unfrozen after DDP was built",
        detail="requires_grad was set to True after DDP was built. DDP's reducer has no hook for them, so "
               "their gradients are never all-reduced and each rank trains its own copy silently." + note,
        params=params, ranks=ranks, steps=steps, fix=fix)


def wrapper_bypass(*, title: str, detail: str, params: list[ParamRef], ranks: list[int], steps: list[int],
                   fix: str) -> Finding:
    """The module inside DDP ran forward in grad mode without DDP's forward around it. Always an ``error``."""
    return Finding(code="wrapper-bypass", severity="error", title=title, detail=detail, params=params, ranks=ranks,
                   steps=steps, fix=fix)


def replica_divergence(*, title: str, detail: str, params: list[ParamRef], ranks: list[int], steps: list[int],
                       fix: str, rounding_only: bool = False) -> Finding:
    """Parameter values differ across ranks. An ``error``, except a ``warning`` when every difference is at float64
    rounding level (`ddp_doctor.replicas.ROUNDING_RELATIVE`: bit-identical weights summed with different thread
    counts), which only a fingerprint comparison can tell."""
    return Finding(code="replica-divergence", severity="warning" if rounding_only else "error", title=title,
                   detail=detail, params=params, ranks=ranks, steps=steps, fix=fix)


def buffer_divergence(*, title: str, detail: str, params: list[ParamRef], ranks: list[int], steps: list[int],
                      fix: str) -> Finding:
    """Buffers (BatchNorm statistics) differ across ranks. A ``warning``: training stays correct, evaluation and
    the saved buffers depend on the rank."""
    return Finding(code="buffer-divergence", severity="warning", title=title, detail=detail, params=params,
                   ranks=ranks, steps=steps, fix=fix)
