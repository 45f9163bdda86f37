"""Round C of the check's exchange, run only when some gradient or weight differs across the ranks: each rank's
digest of its differing slices against group rank 0's (to name the ranks that differ), then rank 0's fingerprints
of those slices, sent once (for the largest weight gap and the divergence curve)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ddp_doctor.core.records import RankRecord
from ddp_doctor.exchange.packing import MaxRound, Op, Reply, element_hashes, to_words
from ddp_doctor.exchange.patterns import local_gaps

__all__ = ["Rank0Slices", "against_rank0"]


@dataclass
class Rank0Slices:
    """This rank's differing gradients and weights against group rank 0's, over the common steps `s`."""

    grad_mine: int
    grad_ref: int
    weight_mine: int
    weight_ref: int
    weight_nan: bool
    """Some differing weight fingerprint is NaN on this rank."""
    weight_nan0: bool
    """... on group rank 0."""
    gap: float
    """The largest weight difference from rank 0's, in the first fingerprint component."""
    w_curve: torch.Tensor
    g_curve: torch.Tensor
    w_missing: torch.Tensor
    g_missing: torch.Tensor

    @classmethod
    def none(cls, s: int) -> Rank0Slices:
        """Nothing differs: no round was run."""
        return cls(
            grad_mine=0,
            grad_ref=0,
            weight_mine=0,
            weight_ref=0,
            weight_nan=False,
            weight_nan0=False,
            gap=0.0,
            w_curve=torch.zeros(s + 1, dtype=torch.float64),
            g_curve=torch.zeros(s, dtype=torch.float64),
            w_missing=torch.zeros(s + 1, 0, dtype=torch.bool),
            g_missing=torch.zeros(s, 0, dtype=torch.bool),
        )

    @property
    def grad_differs(self) -> bool:
        return self.grad_mine != self.grad_ref

    @property
    def weight_differs(self) -> bool:
        return self.weight_mine != self.weight_ref or self.weight_nan or self.weight_nan0


def against_rank0(
    record: RankRecord,
    s: int,
    *,
    grad_params: torch.Tensor,
    weight_params: torch.Tensor,
    trained_by_all: torch.Tensor,
    grad_hashes: Callable[[], torch.Tensor],
    rank: int,
) -> Generator[Op, Reply, Rank0Slices]:
    """Round C (two collectives) when `grad_params` or `weight_params` has a parameter, else nothing is sent.
    `trained_by_all`: bool[S, P], the steps and parameters every rank trained (the gradient curve's cells)."""
    if not bool(grad_params.any() or weight_params.any()):
        return Rank0Slices.none(s)
    c = MaxRound()
    grad_mine = int(grad_hashes()[:, grad_params].sum()) if s else 0
    w_slice = record.weight_fp[: s + 1][:, weight_params]
    g_slice = record.grad_fp[:s][:, grad_params]
    weight_mine = int(element_hashes(w_slice).sum()) if w_slice.numel() else 0
    weight_nan = bool(w_slice.isnan().any())
    c.slot("ref", torch.tensor([grad_mine, weight_mine, int(weight_nan)]), rank == 0)
    ref = c.read((yield ("max", c.tensor())))["ref"]
    both = torch.cat([w_slice.reshape(-1), g_slice.reshape(-1)]).to(torch.float64)
    words = to_words(both.contiguous().numpy().tobytes() if rank == 0 else b"", both.numel())
    got = yield ("sum", words if rank == 0 else torch.zeros_like(words))
    fp0 = got.tensor.view(torch.float64)
    w0, g0 = fp0[: w_slice.numel()].reshape(w_slice.shape), fp0[w_slice.numel() :].reshape(g_slice.shape)
    gap = float((w_slice[..., 0] - w0[..., 0]).abs().nan_to_num(0).max()) if w_slice.numel() else 0.0
    w_curve, w_missing = local_gaps(w_slice, w0, torch.ones(w_slice.shape[:2], dtype=torch.bool))
    g_curve, g_missing = local_gaps(g_slice, g0, trained_by_all[:, grad_params])
    return Rank0Slices(
        grad_mine=grad_mine,
        grad_ref=int(ref[0]),
        weight_mine=weight_mine,
        weight_ref=int(ref[1]),
        weight_nan=weight_nan,
        weight_nan0=bool(ref[2]),
        gap=gap,
        w_curve=w_curve,
        g_curve=g_curve,
        w_missing=w_missing,
        g_missing=g_missing,
    )
