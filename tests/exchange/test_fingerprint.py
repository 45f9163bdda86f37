"""fingerprints_batched(): the same numbers as fingerprints() up to float64 rounding, for any batching; and which
gradients are more than round-off (`significant`)."""

from __future__ import annotations

import pytest
import torch

from ddp_doctor.core.fingerprint import fingerprints, fingerprints_batched, significant


def _tensors() -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    out: list[torch.Tensor | None] = []
    for _ in range(5):
        out += [torch.randn(16, 16, generator=g), torch.randn(16, generator=g), torch.ones(16)]
    return out + [
        None,
        torch.randn(1000, generator=g),
        torch.randn(3, generator=g).double(),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.empty(0),
        torch.tensor(float("nan")),
        torch.tensor([float("inf"), 1.0]),
        torch.randn(4, 4, generator=g).t(),
        torch.randn(5, dtype=torch.complex64, generator=g),
    ]


@pytest.mark.parametrize("chunk", [None, 1, 16, 100, 1 << 20])
def test_batched_matches_the_per_tensor_fingerprints(chunk) -> None:
    ts = _tensors()
    a, b = fingerprints(ts), fingerprints_batched(ts, chunk_elements=chunk)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
    finite = a.isfinite()
    assert torch.allclose(a[finite], b[finite], rtol=1e-12, atol=1e-12)


def test_batched_sees_a_one_ulp_change_and_a_swap() -> None:
    ts = [t for t in _tensors() if t is not None and t.numel() > 1 and t.dtype == torch.float32]
    base = fingerprints_batched(ts, chunk_elements=100)
    for i, t in enumerate(ts):
        if not t.isfinite().all():
            continue
        flat = t.contiguous().view(-1)
        nudged = flat.clone()
        nudged[-1] = torch.nextafter(nudged[-1], torch.tensor(float("inf")))
        swapped = flat.clone()
        swapped[[0, -1]] = swapped[[-1, 0]]
        for changed in (nudged.view_as(t), swapped.view_as(t)):
            if torch.equal(changed, t):
                continue
            again = fingerprints_batched(ts[:i] + [changed] + ts[i + 1 :], chunk_elements=100)
            assert not torch.equal(again[i], base[i]), (i, changed)
            assert torch.equal(torch.cat([again[:i], again[i + 1 :]]), torch.cat([base[:i], base[i + 1 :]]))


def test_a_complex_tensor_differing_in_its_imaginary_part_only_differs() -> None:
    """A complex parameter (a spectral filter) whose imaginary part alone differs across ranks: a cast to float64
    dropped that part, and the ranks' weights compared equal while 0.5 apart (and torch warned from our code)."""
    a = torch.randn(9, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b.imag.add_(0.5)
    for fp in (fingerprints, fingerprints_batched):
        assert not torch.equal(fp([a]), fp([b]))
        assert torch.equal(fp([a]), fp([a.clone()]))
    assert torch.equal(fingerprints([a.conj()]), fingerprints([a.conj().resolve_conj()]))


def test_a_gradient_of_round_off_only_is_not_significant() -> None:
    """Linear then BatchNorm: the Linear's bias gets about 1e-8 (zero in exact arithmetic) where the rest get about
    1e-2; an absent gradient (NaN) and an exact zero are not significant either."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )
    torch.nn.functional.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 2, (8,))).backward()
    grads = [p.grad for p in model.parameters()] + [None, torch.zeros(3)]
    peaks = fingerprints(grads).abs().amax(-1)
    assert significant(peaks).tolist() == [True, False, True, True, True, True, False, False]
    assert significant(torch.tensor([float("nan")])).tolist() == [False]
