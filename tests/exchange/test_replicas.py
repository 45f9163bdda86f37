"""replicas: which tensors differ across ranks, named with the odd ranks, on real gloo groups."""

from __future__ import annotations

import torch
from dist import run_ranks

from ddp_doctor.exchange.replicas import Difference, Entry, compare_replicas, describe, local_rows, report_failure

_CPU = torch.device("cpu")


def _entries(rank: int, change: str | None, odd: int) -> list[Entry]:
    a = torch.arange(6, dtype=torch.float32)
    b = torch.ones(3, 3)
    if rank == odd:
        if change == "value":
            b[1, 1] += 1e-3
        elif change == "nan":
            b[0, 0] = float("nan")
    absent = change == "absent" and rank == odd
    return [
        Entry("a", "param", 6, a),
        Entry("b", "param", 9, b),
        Entry("m", "buffer", 0 if absent else 2, None if absent else torch.zeros(2)),
    ]


def _compare(rank: int, world: int, change: str | None) -> dict:
    comparison = compare_replicas(_entries(rank, change, odd=world - 1), group=None, device=_CPU)
    return {
        "ok": comparison.ok,
        "failed": comparison.failed_ranks,
        "diffs": [(d.name, d.kind, d.ranks, d.reference_rank, d.gap == float("inf")) for d in comparison.differences],
    }


def test_identical_replicas_are_ok(tmp_path) -> None:
    assert run_ranks(_compare, tmp_path, world_size=3, args=(None,)) == [{"ok": True, "failed": [], "diffs": []}] * 3


def test_a_changed_tensor_is_named_with_the_odd_rank(tmp_path) -> None:
    expected = {"ok": False, "failed": [], "diffs": [("b", "param", [2], 0, False)]}
    assert run_ranks(_compare, tmp_path, world_size=3, args=("value",)) == [expected] * 3


def test_nan_and_absence_are_differences_of_infinite_size(tmp_path) -> None:
    assert run_ranks(_compare, tmp_path, args=("nan",))[0]["diffs"] == [("b", "param", [1], 0, True)]
    assert run_ranks(_compare, tmp_path, args=("absent",))[0]["diffs"] == [("m", "buffer", [1], 0, True)]


def _one_rank_fails(rank: int, world: int) -> list[int]:
    entries = _entries(rank, None, odd=-1)
    if rank == 1:
        return report_failure(entries, group=None, device=_CPU).failed_ranks
    return compare_replicas(entries, group=None, device=_CPU).failed_ranks


def test_a_local_failure_reaches_every_rank(tmp_path) -> None:
    assert run_ranks(_one_rank_fails, tmp_path, world_size=3) == [[1]] * 3


def test_local_rows_encode_values_classes_and_absence() -> None:
    rows = local_rows(
        [
            Entry("x", "param", 2, torch.tensor([1.0, 2.0])),
            Entry("y", "param", 1, torch.tensor([float("inf")])),
            Entry("z", "buffer", 0, None),
        ]
    )
    assert rows.shape == (3, 4) and rows.dtype == torch.float64
    assert rows[0, 0] == 3.0 and rows[0, 2:].tolist() == [1.0, 1.0]  # the plain sum; both fingerprints finite
    assert rows[1, 2] == 3.0 and rows[1, 0] == 0.0  # +inf: class code 3, value zeroed
    assert rows[2, 2:].tolist() == [0.0, 0.0]  # absent


def test_describe_lists_each_difference_and_the_rest_as_a_count() -> None:
    diffs = [Difference(f"p{i}", "param", 10, [1], 0, 0.5, 0.1) for i in range(10)]
    text = describe(diffs, limit=2)
    assert text.splitlines() == [
        "  p0 (10 elements): rank(s) [1] differ from rank 0; fingerprint differs by 0.5",
        "  p1 (10 elements): rank(s) [1] differ from rank 0; fingerprint differs by 0.5",
        "  ... and 8 more",
    ]
    assert "float64 rounding level" in describe([Difference("q", "param", 1, [1], 0, 1e-20, 1e-17)])
