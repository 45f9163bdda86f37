"""Compare this rank's copy of named tensors with every other rank's, in one small fixed-shape collective.

Used by `guard` (every N optimizer steps, and before a checkpoint is saved) and by `refreeze` (before DDP is
rebuilt). Each tensor becomes one row of four float64 numbers: the two fingerprints of `ddp_doctor.core.fingerprint`
(a plain sum and a golden-ratio weighted sum), each split into a finite value and a class code (finite, NaN, +inf,
-inf, absent), so NaN never reaches a MAX reduction. One extra row carries this rank's status, so a rank whose
local part failed is known to every rank and all of them stop together.

Steady state costs one all_reduce(MAX) of ``2 * 4 * (K + 1)`` float64 numbers. Only when some row differs (every
rank sees the same maximum and minimum, so every rank takes that branch together) do more all_reduces follow, over
the differing rows only, to find the reference copy and name the ranks that differ from it (`ddp_doctor.exchange.oddranks`):
up to `EXAMPLES` ranks per row plus a count of the others, in a volume per rank that does not grow with the world
size. A rank failure is named the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddp_doctor.core.fingerprint import fingerprints_batched
from ddp_doctor.core.ranks import named_ranks
from ddp_doctor.exchange.oddranks import CANDIDATES, EXAMPLES, name_flagged, odd_ranks
from ddp_doctor.exchange.primitives import global_ranks, minmax

__all__ = ["EXAMPLES", "Comparison", "Difference", "Entry", "compare_replicas", "describe"]

# Below this relative size a difference is at float64 rounding level. Bit-identical float32 tensors summed in float64
# with different intra-op thread counts differed here by about 2e-16 relative (4M elements, 1 vs 16 threads), while
# changing one float32 element of such a tensor by one ulp moves its sum by about 3e-11 relative.
ROUNDING_RELATIVE = 1e-15

_ABSENT, _FINITE, _NAN, _POSINF, _NEGINF = 0.0, 1.0, 2.0, 3.0, 4.0


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor to compare: a parameter, a buffer, or a parameter's optimizer state."""

    name: str
    kind: str
    """``"param"``, ``"buffer"`` or ``"optimizer-state"``."""
    numel: int
    tensor: torch.Tensor | list[torch.Tensor] | None
    """The tensor; a list is fingerprinted as the sum of its members' fingerprints; None means absent."""


@dataclass(frozen=True, slots=True)
class Difference:
    """A tensor whose copies differ across ranks."""

    name: str
    kind: str
    numel: int
    ranks: list[int]
    """Global ranks whose copy differs from the reference rank's: the lowest `EXAMPLES` of them (all of them when
    `more_ranks` is 0)."""
    reference_rank: int
    """The global rank holding the most common copy (the lowest such rank on a tie); see `reference_proven`."""
    gap: float
    """The largest absolute difference of a fingerprint between any two ranks (inf when NaN/inf/absent differ)."""
    relative_gap: float
    more_ranks: int = 0
    """How many further ranks differ from the reference rank's copy, beyond those in `ranks`."""
    reference_proven: bool = True
    """False when the ranks hold several copies and none of the first `CANDIDATES` (by lowest holder) could be
    proven the most common with a bounded exchange: `reference_rank` then holds the most common of those."""

    @property
    def rounding_only(self) -> bool:
        """True when the difference is at float64 rounding level (see `ROUNDING_RELATIVE`)."""
        return self.relative_gap <= ROUNDING_RELATIVE


@dataclass(slots=True)
class Comparison:
    """The outcome of `compare_replicas`, identical on every rank."""

    differences: list[Difference] = field(default_factory=list)
    failed_ranks: list[int] = field(default_factory=list)
    """Global ranks that reported a local failure (the lowest `EXAMPLES` of them); when non-empty, `differences` is
    empty."""
    more_failed: int = 0
    """How many further ranks reported a local failure, beyond those in `failed_ranks`."""

    @property
    def ok(self) -> bool:
        return not self.differences and not self.failed_ranks

    def of_kind(self, *kinds: str) -> list[Difference]:
        return [d for d in self.differences if d.kind in kinds]


def _encode(fp: torch.Tensor) -> torch.Tensor:
    """float64[K, 2] fingerprints -> float64[K, 4]: finite values (non-finite zeroed) and class codes."""
    cls = torch.full_like(fp, _FINITE)
    cls[fp.isnan()] = _NAN
    cls[fp == float("inf")] = _POSINF
    cls[fp == float("-inf")] = _NEGINF
    return torch.cat([torch.where(cls == _FINITE, fp, torch.zeros_like(fp)), cls], dim=1)


def local_rows(entries: Sequence[Entry]) -> torch.Tensor:
    """This rank's rows, float64[K, 4] on CPU (the local part of `compare_replicas`)."""
    singles = [e.tensor if not isinstance(e.tensor, list) else None for e in entries]
    fp = fingerprints_batched(singles)
    for i, e in enumerate(entries):
        if isinstance(e.tensor, list):
            fp[i] = fingerprints_batched(e.tensor).sum(0) if e.tensor else float("nan")
    rows = _encode(fp)
    absent = torch.tensor(
        [e.tensor is None or (isinstance(e.tensor, list) and not e.tensor) for e in entries], dtype=torch.bool
    )
    rows[absent, 2:] = _ABSENT
    return rows


def compare_replicas(
    entries: Sequence[Entry],
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rows: torch.Tensor | None = None,
    examples: int = EXAMPLES,
) -> Comparison:
    """Compare `entries` across the ranks of `group`. Collective; `len(entries)` must be equal on every rank.

    Args:
        entries: the tensors, in an order identical on every rank.
        group: the process group (None: the default group).
        device: where the collective's tensors live (CPU for gloo, the rank's CUDA device for NCCL).
        rows: this rank's rows from `local_rows(entries)`, or None to compute them here. A rank whose local
            part failed calls `report_failure` instead, with the same `entries`.
        examples: how many ranks to name per difference (and of the failed ranks); the others are counted. Equal
            on every rank.

    Returns:
        A `Comparison`, identical on every rank.
    """
    if rows is None:
        rows = local_rows(entries)
    return _compare(entries, rows, status=0.0, group=group, device=device, examples=examples)


def failed_rows(n: int) -> torch.Tensor:
    """Placeholder rows for a rank whose local part failed; pass them to `report_failure`."""
    return torch.zeros(n, 4, dtype=torch.float64)


def report_failure(
    entries: Sequence[Entry], *, group: dist.ProcessGroup | None, device: torch.device, examples: int = EXAMPLES
) -> Comparison:
    """Take part in the comparison after this rank's local part failed, so every rank learns it. Collective."""
    return _compare(entries, failed_rows(len(entries)), status=1.0, group=group, device=device, examples=examples)


def _compare(
    entries: Sequence[Entry],
    rows: torch.Tensor,
    *,
    status: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
    examples: int,
) -> Comparison:
    payload = torch.cat([rows, torch.tensor([[status, 0.0, 0.0, 0.0]], dtype=torch.float64)])
    hi, lo = minmax(payload, group, device)
    if hi[-1, 0] > 0:
        [failed] = name_flagged(torch.tensor([status > 0]), group=group, device=device, limit=examples)
        return Comparison(failed_ranks=global_ranks(group, failed.examples), more_failed=failed.more)
    hi, lo = hi[:-1], lo[:-1]
    differ = (hi != lo).any(1).nonzero().flatten()
    if not len(differ):
        return Comparison()

    differences = []
    for i, odd in zip(differ.tolist(), odd_ranks(rows[differ], group=group, device=device, limit=examples)):
        classes_differ = bool((hi[i, 2:] != lo[i, 2:]).any())
        gap = float("inf") if classes_differ else float((hi[i, :2] - lo[i, :2]).abs().max())
        scale = float(torch.maximum(hi[i, :2].abs(), lo[i, :2].abs()).max())
        relative = float("inf") if classes_differ else gap / max(scale, 1e-300)
        e = entries[i]
        differences.append(
            Difference(
                name=e.name,
                kind=e.kind,
                numel=e.numel,
                ranks=global_ranks(group, odd.odd.examples),
                reference_rank=global_ranks(group, [odd.reference])[0],
                gap=gap,
                relative_gap=relative,
                more_ranks=odd.odd.more,
                reference_proven=odd.proven,
            )
        )
    return Comparison(differences=differences)


def describe(differences: Sequence[Difference], *, limit: int = 8) -> str:
    """One line per difference (up to `limit`): name, size, ranks, and the size of the difference."""
    lines = []
    for d in differences[:limit]:
        size = "NaN/inf or presence differs" if d.gap == float("inf") else f"fingerprint differs by {d.gap:.3g}"
        note = " (float64 rounding level: do the ranks use different thread counts?)" if d.rounding_only else ""
        if not d.reference_proven:
            note += (
                f" (rank {d.reference_rank}'s copy is only the most common of the first {CANDIDATES} copies "
                "compared: the ranks hold more, and one of those may be more common)"
            )
        lines.append(
            f"  {d.name} ({d.numel:,} elements): {named_ranks(d.ranks, d.more_ranks)} differ from rank "
            f"{d.reference_rank}; {size}{note}"
        )
    if len(differences) > limit:
        lines.append(f"  ... and {len(differences) - limit} more")
    return "\n".join(lines)
