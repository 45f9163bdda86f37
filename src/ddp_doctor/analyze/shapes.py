"""`param-shapes-differ`: the ranks handed DDP's constructor different parameters. When the shapes differ, DDP
refused the model: each rank wrote the names and shapes it handed to DDP just before the constructor ran
(`core/rankfiles.py`, `WrapShapes`), and `shape_findings` names each differing parameter with its shape on each rank
(rank states in, findings out). When only which parameters are trainable differs, in a way whose shapes line up,
DDP accepted the model and pairs different parameters in its all-reduce: `trainable_apart_at_wrap` names them from
the exchange's `Summary.wrap_trainable`; for a sharded model, `trainable_apart_sharded` from the modes the ranks
held apart at a step (`ShardedRun.modes_apart`)."""

from __future__ import annotations

import math
import re
from typing import Any

from ddp_doctor.analyze.common import with_more
from ddp_doctor.analyze.parallelism import apart_args, frozen_apart
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef, lines_of
from ddp_doctor.core.rankfiles import ExplainedError
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.rankstate import RankState
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = [
    "SHAPE_ERROR",
    "explain_shape_error",
    "refused_at_wrap",
    "shape_findings",
    "trainable_apart_at_step",
    "trainable_apart_at_wrap",
]


SHAPE_ERROR = re.compile(
    r"params\[(\d+)\] in this process with sizes \[([\d, ]*)\] appears not to match sizes of the same param in "
    r"process (\d+)"
)
"""DDP's constructor (`_verify_param_shape_across_processes`) refusing a model whose shapes differ by rank."""
_NAMED = 6
"""Parameters trainable on some ranks only that a finding names one by one (the rest are counted)."""
COUNT_ERROR = re.compile(r"DDP expects same model across all ranks, but Rank (\d+) has (\d+) params, while rank (\d+)")
"""The same constructor refusing a model with another number of trainable parameters on some rank (a parameter
frozen, or added, on some ranks only)."""


def _refusal(message: str) -> re.Match[str] | None:
    return SHAPE_ERROR.search(message) or COUNT_ERROR.search(message)


def explain_shape_error(message: str) -> ExplainedError | None:
    """What a rank's end record says of an error `message` that is DDP's constructor refusing shapes that differ by
    rank (None for any other error): the report names the parameters from every rank's wrap record
    (`shape_findings`), so the traceback adds nothing."""
    if not _refusal(message):
        return None
    return ExplainedError(
        code=Code.PARAM_SHAPES_DIFFER, message="DDP's constructor found parameter shapes that differ between ranks."
    )


def refused_at_wrap(states: dict[int, RankState]) -> bool:
    """Whether DDP's constructor refused the model on some rank because its shapes differ by rank: a finding
    (`param-shapes-differ`), not a failure to run."""
    return bool(shape_findings(states))


def _shape(shape: list[int] | tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def shape_findings(states: dict[int, RankState]) -> list[Finding]:
    """`param-shapes-differ` when DDP's constructor refused the model on some rank because a parameter's shape
    differs from rank 0's: each differing parameter by name with its shape on each rank (from the ranks' wrap
    records), else what the error itself says."""
    refused = {r: m for r, s in sorted(states.items()) if s.raised is not None and (m := _refusal(s.raised.message))}
    if not refused:
        return []
    wraps = {r: s.wrap for r, s in sorted(states.items()) if s.wrap is not None}
    per_name: dict[str, dict[int, tuple[int, ...]]] = {}
    for r, w in wraps.items():
        for name, shape in zip(w.names, w.shapes):
            per_name.setdefault(name, {})[r] = tuple(shape)
    differing = {n: by_rank for n, by_rank in per_name.items() if len(set(by_rank.values())) > 1}
    counts = {r: len(w.names) for r, w in wraps.items()}
    # Trainable on some ranks only: frozen (requires_grad=False) or absent on the others.
    some = {n: sorted(by_rank) for n, by_rank in per_name.items() if len(by_rank) < len(wraps)}
    lines, params = [], []
    for name, by_rank in differing.items():
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, shape in sorted(by_rank.items()):
            groups.setdefault(shape, []).append(r)
        lines.append(f"{name} is " + ", ".join(f"{_shape(sh)} on {rank_list(rs)}" for sh, rs in groups.items()))
        first = by_rank[min(by_rank)]
        params.append(ParamRef(name, math.prod(first), first))
    if some:
        lines.append(
            "; ".join(f"{name} is trainable on {rank_list(rs)} only" for name, rs in list(some.items())[:_NAMED])
            + (f" (+{len(some) - _NAMED} more)" if len(some) > _NAMED else "")
        )
        for name, rs in some.items():
            shape = tuple(wraps[rs[0]].shapes[wraps[rs[0]].names.index(name)])
            params.append(ParamRef(name, math.prod(shape), shape))
    if not differing and not some:
        # No wrap records (or the same names and shapes, with parameters missing on some rank): DDP's words.
        for r, m in refused.items():
            if m.re is COUNT_ERROR:
                lines.append(f"rank {r} has {m.group(2)} trainable parameters, not as many as rank {m.group(3)}")
                continue
            index, sizes, other = int(m.group(1)), m.group(2), int(m.group(3))
            name = wraps[r].names[index] if r in wraps and index < len(wraps[r].names) else f"params[{index}]"
            lines.append(f"{name} is [{sizes}] on rank {r}, not the shape it has on rank {other}")
    measured = []
    if len(set(counts.values())) > 1:
        lines.append(
            "the number of trainable parameters differs too: "
            + ", ".join(f"{n} on rank {r}" for r, n in sorted(counts.items()))
        )
        measured = [Measure(f"trainable_parameters (rank {r})", n, "count") for r, n in sorted(counts.items())]
    site = next((w.site for w in wraps.values() if w.site), None) or next(
        (states[r].raised.site for r in refused if states[r].raised.site), None
    )
    ranks = sorted({r for by_rank in differing.values() for r in by_rank} | set(refused) | {0})
    if some and not differing:
        return [_trainable_apart(some, lines, params, ranks, site, measured)]
    return [
        Finding(
            code=Code.PARAM_SHAPES_DIFFER,
            measured=measured,
            severity="error",
            title=f"{len(differing) or len(refused)} parameter(s) have different shapes on different ranks when DDP "
            "is built",
            detail=f"DDP's constructor{f' at {site}' if site else ''} compares every parameter's shape with rank "
            f"0's and refused the model: {'; '.join(lines)}. Every rank must build the same model. The likely cause: "
            "the model's size comes from rank-local data, such as the vocabulary (or the number of classes) of "
            "each rank's own data shard.",
            params=params,
            ranks=ranks,
            steps=[],
            fix="build the model from data every rank agrees on: compute the vocabulary (or the size) on rank 0 and "
            "broadcast it before building the model (dist.broadcast_object_list(obj, src=0)), or read it from one "
            "file every rank loads whole.",
        )
    ]


def _trainable_apart(
    some: dict[str, list[int]],
    lines: list[str],
    params: list[ParamRef],
    ranks: list[int],
    site: str | None,
    measured: list[Measure],
) -> Finding:
    """`param-shapes-differ` for a model whose trainable parameters differ by rank, shapes alike: a layer frozen on
    some ranks only before the wrap (a rank-local config).

    Ground truth (tests/failures/test_check_failures.py): under plain torchrun, `requires_grad_(False)` on rank 0's first layer
    before `DistributedDataParallel(model)`: both ranks fail in DDP's constructor with 'DDP expects same model across
    all ranks, but Rank 0 has 4 params, while rank 1 has inconsistent 6 params' (exit 1)."""
    return Finding(
        code=Code.PARAM_SHAPES_DIFFER,
        severity="error",
        title=f"{len(some)} parameter(s) are trainable on some ranks only when DDP is built",
        measured=measured,
        detail=f"DDP's constructor{f' at {site}' if site else ''} verifies that every rank hands it the same "
        f"trainable parameters (those with requires_grad=True) and refused the model: {'; '.join(lines)}. They "
        "were frozen (requires_grad=False), or are absent, on the other ranks: a freeze decided from rank-local "
        "state (a config read on one rank, a rank-dependent branch).",
        params=params,
        ranks=ranks,
        steps=[],
        fix="decide what to freeze identically on every rank before wrapping (from arguments or a file every rank "
        "reads, or broadcast rank 0's choice with dist.broadcast_object_list), then build DDP.",
    )


@detects(Code.PARAM_SHAPES_DIFFER)
def trainable_apart_at_wrap(v: View) -> list[Finding]:
    """Parameters trainable on some ranks and frozen on others when DDP was built, with the trainable shapes in the
    same order on every rank, so that DDP's constructor (which compares shapes) accepted the model.

    Ground truth (tests/sync/test_check_frozen_apart.py): under plain torchrun, a five-layer model whose rank 0
    freezes its first Linear(8, 8) and rank 1 its second before `DistributedDataParallel(model)` (each rank fine-tunes
    "its" block): exit 0, 12 steps, the two blocks 0.016 (weights) and 0.033 (biases) apart, the head equal: DDP
    averaged rank 0's gradient of the second block with rank 1's gradient of the first, bucket slot by slot."""
    wrap = v.summary.wrap_trainable
    if wrap is None or not v.wrap_apart.any():
        return []
    apart = [int(i) for i in v.wrap_apart.nonzero().flatten()]
    lines = [
        f"{v.info.param_names[i]} on {int(wrap[i, 0])} of {v.world} ranks (rank {int(wrap[i, 1])} trainable, rank "
        f"{int(wrap[i, 2])} frozen)"
        for i in apart[:_NAMED]
    ]
    more = f" (+{len(apart) - _NAMED} more)" if len(apart) > _NAMED else ""
    ranks = sorted({int(r) for i in apart for r in wrap[i, 1:].tolist() if r >= 0})
    site = f" at {v.info.ddp_site}" if v.info.ddp_site else ""
    return [
        Finding(
            code=Code.PARAM_SHAPES_DIFFER,
            severity="error",
            title=f"{len(apart)} parameter(s) were trainable on some ranks only when DDP was built",
            detail=f"The ranks handed DDP's constructor{site} different trainable parameters (requires_grad=True): "
            f"{'; '.join(lines)}{more}. Their shapes line up, so the constructor, which compares shapes, accepted "
            "the model, and DDP's all-reduce pairs different parameters bucket slot by slot: each rank steps its "
            "trainable parameters with the average of its own gradients and other parameters' gradients from the "
            "other ranks. A freeze decided from rank-local state (a config read on one rank, a rank-dependent branch).",
            params=v.params(v.wrap_apart),
            ranks=ranks,
            steps=[],
            fix="decide what to freeze identically on every rank before wrapping (from arguments or a file every rank "
            "reads, or broadcast rank 0's choice with dist.broadcast_object_list), then build DDP.",
            sites=lines_of(v.info.ddp_site or ""),
        )
    ]


_TRAINABLE_APART = {
    "fsdp2": "FSDP2 reduce-scatters the gradients of the groups each rank trains: groups of the same size pair up "
    "across ranks and mix their gradients, so each shard steps with another layer's gradient from the other ranks "
    "(groups of different sizes make the job hang instead)",
    "replicate": "replicate all-reduces the gradients of the groups each rank trains: groups of the same size pair "
    "up across ranks and mix their gradients, and the replicas drift apart",
}


@detects(Code.PARAM_SHAPES_DIFFER, road="sharded")
def trainable_apart_sharded(run: ShardedRun) -> list[Finding]:
    """A sharded model whose ranks' parameters differ in `requires_grad` at an observed step."""
    modes = run.modes_apart
    if modes is None or not frozen_apart(modes):
        return []
    found = trainable_apart_at_step(**apart_args(modes), parallelism=parallelism_of(run.sharding))
    return [with_more(found, modes.more)]


def trainable_apart_at_step(
    *, step: int, held: dict[int, dict[str, Any]], reference: int, ranks: list[int], parallelism: str
) -> Finding:
    """`param-shapes-differ` for an FSDP2 or `replicate` model whose parameters' `requires_grad` differ across ranks
    when optimizer step `step` ended: `held` maps ranks to their modes entry (`frozen`, `frozen_count`:
    `observation.tree_scan.modes_of`), `reference` first.

    Ground truth (tests/sync/test_check_frozen_apart.py): under plain torchrun, FSDP2 on every Linear of a
    five-layer MLP, rank 0 freezing its first Linear(8, 8) and rank 1 its second before `fully_shard`: exit 0 after 12
    steps, nothing said; both blocks moved (each rank's shard of the block it trains) and the gathered weights match
    neither run that freezes the same block on every rank (the first block's weights sum to -1.26177, against
    -1.34581 frozen and -1.36232 trained everywhere). With a Linear(8, 8) frozen on rank 0 and the Linear(8, 4) head on
    rank 1 (groups of different sizes) the job hangs (killed after 60 s). Tried by hand under `replicate`
    (`replicate_with_fsdp`, the same freeze): exit 0, the two blocks 0.0157 (weights) and 0.0327 (biases) apart
    after 12 steps, the head equal; named the same way, with the drift as its consequence."""
    said = []
    for r, entry in list(held.items())[:4]:
        frozen = entry.get("frozen") or []
        more = int(entry.get("frozen_count", len(frozen))) - len(frozen)
        said.append(
            f"rank {r} froze {', '.join(frozen)}{f' (+{more} more)' if more > 0 else ''}"
            if frozen
            else f"rank {r} trains every parameter"
        )
    numels = {n: k for e in held.values() for n, k in zip(e.get("frozen") or [], e.get("frozen_numels") or [])}
    return Finding(
        code=Code.PARAM_SHAPES_DIFFER,
        severity="error",
        title=f"parameters are trainable on some ranks only at step {step}",
        detail=f"When optimizer step {step} ended, the ranks' parameters did not require a gradient alike "
        f"({'; '.join(said)}). {_TRAINABLE_APART.get(parallelism, _TRAINABLE_APART['fsdp2'])}. A freeze decided from "
        "rank-local state (a config read on one rank, a rank-dependent branch).",
        params=[ParamRef(n, numels[n]) for n in sorted(numels)],
        ranks=ranks,
        steps=[step],
        fix="decide what to freeze identically on every rank (from arguments or a file every rank reads, or "
        "broadcast rank 0's choice with dist.broadcast_object_list).",
    )
