"""Cheap, deterministic tensor fingerprints that are equal across ranks exactly when the tensors (almost surely) are.

A fingerprint is two float64 numbers: the plain sum, and a sum weighted by a fixed pseudo-random pattern of the
element index. The second catches permutations and sign flips that cancel in the first. Both are computed by the
same code on the same shape on every rank, so bit-identical tensors give bit-identical fingerprints.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["MISSING", "fingerprint", "fingerprints"]

MISSING = float("nan")
"""The fingerprint of an absent tensor (a `None` grad)."""

# Golden-ratio weights: frac(i * phi) is equidistributed and needs no random generator or cached storage.
_PHI = 0.6180339887498949


def _weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.frac(torch.arange(1, n + 1, dtype=torch.float64, device=device) * _PHI) + 0.5


def fingerprint(t: torch.Tensor | None) -> tuple[float, float]:
    """Fingerprint one tensor; `(nan, nan)` for `None`."""
    if t is None:
        return (MISSING, MISSING)
    return tuple(_fingerprint_tensor(t).tolist())  # type: ignore[return-value]


def _fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach()
    if flat.is_sparse:
        flat = flat.to_dense()
    flat = flat.reshape(-1).to(torch.float64)
    return torch.stack([flat.sum(), (flat * _weights(flat.numel(), flat.device)).sum()])


def fingerprints(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Fingerprint many tensors into a CPU float64[N, 2]; rows of `None` entries are NaN.

    One device-to-host copy for the whole batch, so it costs one sync on GPU.
    """
    rows: list[torch.Tensor | None] = [None if t is None else _fingerprint_tensor(t) for t in tensors]
    present = [r for r in rows if r is not None]
    out = torch.full((len(rows), 2), MISSING, dtype=torch.float64)
    if present:
        host = torch.stack([r.to(present[0].device) for r in present]).cpu()
        idx = [i for i, r in enumerate(rows) if r is not None]
        out[idx] = host
    return out
