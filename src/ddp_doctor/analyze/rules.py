"""Finding builders shared by `analyze` and `guard`: each code's severity rule and core wording live here once, so a
report and a guard cannot disagree about the same problem. Pure: no communication, nothing read from the process.

Callers add what only they know: where the problem was seen (`note`), the steps and ranks, and the fix in the words
of the framework that built DDP.
"""

from __future__ import annotations

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, ParamRef, count

__all__ = [
    "buffer_divergence",
    "count",
    "frozen_after_wrap",
    "replica_divergence",
    "unfrozen_after_wrap",
    "wrapper_bypass",
]


def frozen_after_wrap(
    *,
    params: list[ParamRef],
    ranks: list[int],
    steps: list[int],
    find_unused: bool,
    static_graph: bool,
    after_first_step: bool,
    fix: str,
    note: str = "",
) -> Finding:
    """Parameters whose `requires_grad` went from True to False after DDP was built.

    Severity, as measured on torch 2.13 (gloo, 2 ranks): ``warning`` with `find_unused_parameters=True` (the graph
    walk marks them ready; they are all-reduced as zeros every step), and with `static_graph=True` when they were
    frozen before the first step (the static graph records them as unused). Otherwise ``error``: with default
    flags, or with `static_graph=True` once a step has trained them (`after_first_step`), the step's reduction
    never finishes, none of its gradients are all-reduced, and the next forward raises *Expected to have finished
    reduction*.
    """
    harmless = find_unused or (static_graph and not after_first_step)
    if harmless:
        detail = "they are still all-reduced every step, which wastes communication."
    elif static_graph:
        detail = (
            "static_graph=True recorded them as used in the first step, so the step's reduction never "
            "finishes, none of the step's gradients are all-reduced, and the next step fails."
        )
    else:
        detail = "with default flags the step's reduction never finishes and the next step fails."
    return Finding(
        code=Code.FROZEN_AFTER_WRAP,
        severity="warning" if harmless else "error",
        title=f"{count(len(params), 'parameter')} frozen after DDP was built",
        detail="requires_grad was set to False after DDP was built. DDP's reducer still expects their gradients: "
        + detail
        + note,
        params=params,
        ranks=ranks,
        steps=steps,
        fix=fix,
    )


def unfrozen_after_wrap(
    *, params: list[ParamRef], ranks: list[int], steps: list[int], fix: str, note: str = ""
) -> Finding:
    """Parameters whose `requires_grad` went from False to True after DDP was built. Always an ``error``: nothing
    ever all-reduces their gradients."""
    return Finding(
        code=Code.UNFROZEN_AFTER_WRAP,
        severity="error",
        title=f"{count(len(params), 'parameter')} unfrozen after DDP was built",
        detail="requires_grad was set to True after DDP was built. DDP's reducer has no hook for them, so "
        "their gradients are never all-reduced and each rank trains its own copy silently." + note,
        params=params,
        ranks=ranks,
        steps=steps,
        fix=fix,
    )


def wrapper_bypass(
    *, title: str, detail: str, params: list[ParamRef], ranks: list[int], steps: list[int], fix: str
) -> Finding:
    """The module inside DDP ran forward in grad mode without DDP's forward around it. Always an ``error``."""
    return Finding(
        code=Code.WRAPPER_BYPASS,
        severity="error",
        title=title,
        detail=detail,
        params=params,
        ranks=ranks,
        steps=steps,
        fix=fix,
    )


def replica_divergence(
    *,
    title: str,
    detail: str,
    params: list[ParamRef],
    ranks: list[int],
    steps: list[int],
    fix: str,
    rounding_only: bool = False,
) -> Finding:
    """Parameter values differ across ranks. An ``error``, except a ``warning`` when every difference is at float64
    rounding level (`ddp_doctor.exchange.replicas.ROUNDING_RELATIVE`: bit-identical weights summed with different thread
    counts), which only a fingerprint comparison can tell."""
    return Finding(
        code=Code.REPLICA_DIVERGENCE,
        severity="warning" if rounding_only else "error",
        title=title,
        detail=detail,
        params=params,
        ranks=ranks,
        steps=steps,
        fix=fix,
    )


def buffer_divergence(
    *, title: str, detail: str, params: list[ParamRef], ranks: list[int], steps: list[int], fix: str
) -> Finding:
    """Buffers (BatchNorm statistics) differ across ranks. A ``warning``: training stays correct, evaluation and
    the saved buffers depend on the rank."""
    return Finding(
        code=Code.BUFFER_DIVERGENCE,
        severity="warning",
        title=title,
        detail=detail,
        params=params,
        ranks=ranks,
        steps=steps,
        fix=fix,
    )


def uneven_inputs(
    *,
    title: str,
    cause: str,
    ranks: list[int],
    steps: list[int],
    note: str = "",
    parallelism: str = "ddp",
    fix: str | None = None,
) -> Finding:
    """Ranks whose training loaders give different numbers of batches per epoch. Always an ``error``: the rank that
    runs out stops calling DDP's all-reduce (an FSDP2 model's all-gathers and reduce-scatters) while the others
    wait in it. `cause` ends with "while the others still train"; `fix` replaces the fix for unequal shares."""
    if parallelism == "ddp":
        waits = "DDP's gradient all-reduce"
        shares = (
            "give every rank the same number of batches: shard with DistributedSampler (equal shares), or use "
            "drop_last=True, or wrap the loop in torch.distributed.algorithms.Join([model]) so ranks that run "
            "out shadow the others' all-reduces (Accelerate: Accelerator(even_batches=True))."
        )
    else:
        waits = "the sharded model's all-gathers and gradient reduce-scatters"
        shares = (
            "give every rank the same number of batches: shard with DistributedSampler (equal shares), or use "
            "drop_last=True (Join does not cover a sharded model; Accelerate: Accelerator(even_batches=True), its "
            "default)."
        )
    return Finding(
        code=Code.UNEVEN_INPUTS,
        severity="error",
        title=title,
        detail=cause + f": they then wait in {waits} for a rank that has stopped, and the job hangs or crashes at "
        "the end of the epoch." + (f" {note}" if note else ""),
        ranks=ranks,
        steps=steps,
        fix=fix or shares,
    )


def sampler_epoch_repeated(
    *, epoch: int | None, ranks: list[int], site: str | None = None, seen: list[int] | None = None
) -> Finding:
    """A shuffling DistributedSampler started a new epoch with the epoch of the last one. A ``warning``.

    Args:
        epoch: the epoch it started with again.
        ranks: where it was seen.
        site: the loader's creation line (or where it was first iterated, said so in the text).
        seen: the sampler's epoch at each start of the loader's iteration.
    """
    where = f" (the DataLoader {site})" if site else ""
    starts = f" The loader started {len(seen)} passes with the sampler's epoch at {seen}." if seen else ""
    return Finding(
        code=Code.SAMPLER_EPOCH_NOT_SET,
        severity="warning",
        title=f"a shuffling DistributedSampler started a new epoch with the same epoch ({epoch}){where}",
        detail="set_epoch was not called between epochs, so every epoch visits the samples in the same order on "
        f"every rank: shuffling only happened once.{starts}",
        ranks=ranks,
        steps=[],
        fix="call sampler.set_epoch(epoch) at the start of every epoch, before iterating the loader.",
    )
