"""Cheap, deterministic tensor fingerprints that are equal across ranks exactly when the tensors (almost surely) are.

A fingerprint is two float64 numbers: the plain sum, and a sum weighted by a fixed pseudo-random pattern of the
element index. The second catches permutations and sign flips that cancel in the first. Both are computed by the
same code on the same shape on every rank, so bit-identical tensors give bit-identical fingerprints.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.nn.parameter import is_lazy

from ddp_doctor.core.compat import is_dtensor

__all__ = [
    "MISSING",
    "NEGLIGIBLE",
    "fingerprint",
    "fingerprints",
    "fingerprints_batched",
    "holds_data",
    "readable",
    "significant",
]

MISSING = float("nan")
"""The fingerprint of an absent tensor (a `None` grad)."""
NEGLIGIBLE = 1e-5
"""A gradient this many times smaller than the median of the model's is numerically zero (`significant`)."""

# Golden-ratio weights: frac(i * phi) is equidistributed and needs no random generator or cached storage.
_PHI = 0.6180339887498949


def _weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.frac(torch.arange(1, n + 1, dtype=torch.float64, device=device) * _PHI) + 0.5


def holds_data(t: torch.Tensor) -> bool:
    """Whether `t` has values to fingerprint: not on the meta device, not a lazy module's uninitialised parameter or
    buffer. A tensor without data fingerprints as absent (NaN), never an error in the user's job."""
    return not (t.is_meta or is_lazy(t))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def readable(t: torch.Tensor) -> bool:
    """Whether `t`'s values can be fingerprinted: it holds data (`holds_data`) and is a plain tensor, a DTensor, or
    a tensor subclass whose ops the fingerprint can run (a quantized weight's subclass often cannot). Its
    fingerprint is then a value, never the NaN row of state the check cannot read."""
    if not holds_data(t):
        return False
    return type(t) in _PLAIN or is_dtensor(t) or _or_none(t) is not None


def fingerprint(t: torch.Tensor | None) -> tuple[float, float]:
    """Fingerprint one tensor; `(nan, nan)` for `None` or a tensor without data."""
    row = _or_none(t)
    return (MISSING, MISSING) if row is None else tuple(row.tolist())  # type: ignore[return-value]


def _fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach()
    if is_dtensor(flat):
        # FSDP2's sharded parameters and gradients: this rank's shard (the ranks hold different shards by design;
        # what the ranks share is compared where a collective already gathers it, never here).
        flat = flat.to_local()
    if flat.is_sparse:
        flat = flat.to_dense()
    flat = _real(flat).reshape(-1).to(torch.float64)
    return torch.stack([flat.sum(), (flat * _weights(flat.numel(), flat.device)).sum()])


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real and imaginary parts side by side (a cast to float64 would drop the imaginary
    part, and a difference across ranks there with it); any other tensor as it is."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def fingerprints(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Fingerprint many tensors into a CPU float64[N, 2]; rows of `None` entries are NaN.

    One device-to-host copy for the whole batch, so it costs one sync on GPU.
    """
    rows: list[torch.Tensor | None] = [_or_none(t) for t in tensors]
    present = [r for r in rows if r is not None]
    out = torch.full((len(rows), 2), MISSING, dtype=torch.float64)
    if present:
        host = torch.stack([r.to(present[0].device) for r in present]).cpu()
        idx = [i for i, r in enumerate(rows) if r is not None]
        out[idx] = host
    return out


def _or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t`'s fingerprint, or None for no tensor, one without data, or a tensor subclass whose values cannot be
    summed (its row is NaN, as an absent tensor's)."""
    if t is None or not holds_data(t):
        return None
    try:
        return _fingerprint_tensor(t)
    except Exception:  # a tensor subclass without the ops: state the check cannot read, not a crash of the job
        return None


def fingerprints_batched(tensors: Iterable[torch.Tensor | None], *, chunk_elements: int | None = None) -> torch.Tensor:
    """`fingerprints`, computed for many tensors at once: the same two numbers per tensor, up to float64 rounding.

    `fingerprints` runs about ten small kernels per tensor, so on a model of many small tensors it is dispatch
    bound (15 ms for 280 tensors of 1.2M elements on one CPU thread, 14x a plain `sum()` per tensor), and a huge
    tensor needs float64 temporaries of three times its size. Here tensors of the same size, dtype and device
    (a model's repeated layers) are stacked into one float64 matrix of at most `chunk_elements` elements and
    reduced row-wise, and a tensor bigger than that is reduced in pieces, so the temporary memory is bounded.
    Only plain sums reduce (deterministic on CPU and CUDA): equal inputs give bit-identical outputs on every rank.

    Args:
        tensors: the tensors; None entries give NaN rows.
        chunk_elements: the most elements reduced in one batch. Default: 2**16 on CPU (512 KiB of float64, which
            stays in the allocator's cache: bigger batches were slower here, from page faults on fresh memory),
            2**24 on other devices (fewer kernel launches).

    Returns:
        A CPU float64[N, 2]; rows of `None` entries are NaN.
    """
    items = list(tensors)
    out = torch.full((len(items), 2), MISSING, dtype=torch.float64)
    groups: dict[tuple[torch.device, int, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    big: list[tuple[int, torch.Tensor]] = []
    results: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    for row, t in enumerate(items):
        if t is None or not holds_data(t):
            continue
        if type(t) not in _PLAIN and not is_dtensor(t):  # a tensor subclass: guarded, one at a time
            one = _or_none(t)
            if one is not None:
                results.setdefault(one.device, []).append(([row], one[None]))
            continue
        flat = t.detach()
        if is_dtensor(flat):
            flat = flat.to_local()  # this rank's shard, as in `fingerprints`
        if flat.is_sparse:
            flat = flat.to_dense()
        flat = _real(flat).reshape(-1)
        if flat.numel() > _chunk(flat.device, chunk_elements):
            big.append((row, flat))
        else:
            groups.setdefault((flat.device, flat.numel(), flat.dtype), []).append((row, flat))
    for (device, n, _), members in groups.items():
        weights = _weights(n, device)
        per_chunk = max(1, _chunk(device, chunk_elements) // max(n, 1))
        for i in range(0, len(members), per_chunk):
            part = members[i : i + per_chunk]
            matrix = torch.stack([flat for _, flat in part]).to(torch.float64)  # [k, n]
            sums = torch.stack([matrix.sum(1), (matrix * weights).sum(1)], dim=1)  # [k, 2]
            results.setdefault(device, []).append(([row for row, _ in part], sums))
    for row, flat in big:
        pieces = []
        size = _chunk(flat.device, chunk_elements)
        for start in range(0, flat.numel(), size):
            piece = flat[start : start + size].to(torch.float64)
            index = torch.arange(start + 1, start + piece.numel() + 1, dtype=torch.float64, device=piece.device)
            pieces.append(torch.stack([piece.sum(), (piece * (torch.frac(index * _PHI) + 0.5)).sum()]))
        results.setdefault(flat.device, []).append(([row], torch.stack(pieces).sum(0, keepdim=True)))
    for parts in results.values():
        rows = [r for part_rows, _ in parts for r in part_rows]
        out[rows] = torch.cat([sums for _, sums in parts]).cpu()  # one device-to-host copy per device
    return out


def _chunk(device: torch.device, chunk_elements: int | None) -> int:
    if chunk_elements is not None:
        return chunk_elements
    return 1 << 16 if device.type == "cpu" else 1 << 24


def significant(magnitudes: torch.Tensor) -> torch.Tensor:
    """bool[N]: which of `magnitudes` (one per tensor: a fingerprint's largest absolute value, or the tensor's;
    NaN for an absent tensor) exceed `NEGLIGIBLE` times the median of the finite ones above 0. A bias followed by a
    normalization layer (Linear then BatchNorm) gets a gradient of float round-off only, about 1e-8 where the
    others' are about 1e-2: it is zero in exact arithmetic, and an optimizer step with it changes nothing."""
    live = magnitudes.isfinite() & (magnitudes > 0)
    if not bool(live.any()):
        return live
    return live & (magnitudes > magnitudes[live].median() * NEGLIGIBLE)
