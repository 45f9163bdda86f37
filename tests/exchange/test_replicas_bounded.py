"""replicas at scale: the odd ranks are named as examples plus a count, in all_reduces whose size does not depend
on the world size; real gloo groups of 2, 4 and 8 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks

from ddp_doctor.exchange.oddranks import CANDIDATES, EXAMPLES
from ddp_doctor.exchange.replicas import Entry, compare_replicas, describe, report_failure

_CPU = torch.device("cpu")

# Each case: which ranks change tensor "b", and how ("same": all by the same amount, "own": each by its own).
_CASES = {
    "one": ([5], "same"),
    "three": ([1, 4, 6], "same"),
    "rank 0": ([0], "same"),
    "half": ([1, 3, 5, 7], "same"),  # a 4-4 tie: rank 0's copy, the lowest rank's, is the reference
    "0 and 1 apart": ([0, 1], "own"),  # the majority copy is the third one compared
    "5 apart": ([0, 1, 2, 3, 4], "own"),  # more minority copies than CANDIDATES before the majority's
    "all apart": (list(range(8)), "own"),
}


def _entries(rank: int, changed: list[int], how: str, k: int = 3) -> list[Entry]:
    entries = []
    for i in range(k):
        t = torch.arange(6, dtype=torch.float32) + i
        if rank in changed and i == 1:
            t[2] += 1e-3 * (1 + (rank if how == "own" else 0))
        entries.append(Entry("b" if i == 1 else f"t{i}", "param", 6, t))
    return entries


def _scenarios(rank: int, world: int) -> dict:
    out = {}
    for name, (changed, how) in _CASES.items():
        examples = 2 if name == "half" else EXAMPLES
        comparison = compare_replicas(_entries(rank, changed, how), group=None, device=_CPU, examples=examples)
        out[name] = {
            "diffs": [
                (d.name, d.ranks, d.more_ranks, d.reference_rank, d.reference_proven) for d in comparison.differences
            ],
            "text": describe(comparison.differences),
        }
    entries = _entries(rank, [], "same")
    if rank in (2, 5, 6):
        failed = report_failure(entries, group=None, device=_CPU, examples=2)
    else:
        failed = compare_replicas(entries, group=None, device=_CPU, examples=2)
    out["failed"] = (failed.failed_ranks, failed.more_failed, failed.differences)
    return out


@pytest.fixture(scope="module")
def eight(tmp_path_factory) -> dict:
    results = run_ranks(_scenarios, tmp_path_factory.mktemp("eight"), world_size=8, timeout=120)
    assert all(r == results[0] for r in results), "every rank must get the same comparison"
    return results[0]


@pytest.mark.parametrize(
    ("case", "ranks", "reference"),
    [("one", [5], 0), ("three", [1, 4, 6], 0), ("rank 0", [0], 1), ("0 and 1 apart", [0, 1], 2)],
)
def test_the_odd_ranks_are_named_exactly_against_the_most_common_copy(eight, case, ranks, reference) -> None:
    assert eight[case]["diffs"] == [("b", ranks, 0, reference, True)]
    assert f"rank(s) {ranks} differ from rank {reference}; fingerprint differs by" in eight[case]["text"]


def test_more_odd_ranks_than_examples_are_counted(eight) -> None:
    assert eight["half"]["diffs"] == [("b", [1, 3], 2, 0, True)]
    assert "b (6 elements): ranks 1, 3 and 2 others differ from rank 0; fingerprint differs by" in eight["half"]["text"]


def test_an_unproven_reference_is_said_to_be_one(eight) -> None:
    # Ranks 5-7 share the most common copy, but the first CANDIDATES copies compared (ranks 0-3) hold one rank each.
    assert CANDIDATES == 4
    assert eight["5 apart"]["diffs"] == [("b", [1, 2, 3, 4, 5, 6, 7], 0, 0, False)]
    assert "most common of the first 4 copies compared" in eight["5 apart"]["text"]
    # Every rank apart (each rank trained its own replica): rank 0, the lowest of equally common copies.
    assert eight["all apart"]["diffs"] == [("b", [1, 2, 3, 4, 5, 6, 7], 0, 0, False)]


def test_failed_ranks_are_named_as_examples_and_a_count(eight) -> None:
    assert eight["failed"] == ([2, 5], 1, [])


# ------------------------------------------------------------------------------------------------ the volume

_OTHER = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
    "recv",
)


def _volume(rank: int, world: int, k: int) -> dict:
    """Bytes passed to all_reduce by one comparison of `k` tensors per pattern, and any other collective called."""
    sent: list[int] = []
    others: list[str] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    def recording(name):
        def call(*args, **kwargs):
            others.append(name)
            return getattr(torch.distributed.distributed_c10d, name)(*args, **kwargs)

        return call

    dist.all_reduce = counting
    for name in _OTHER:
        setattr(dist, name, recording(name))
    # How much this rank adds to every tensor: every tensor differs on the last rank, or on every rank.
    offsets = {"identical": 0.0, "last rank": float(rank == world - 1), "all apart": float(rank), "failed": 0.0}
    out = {}
    for pattern, offset in offsets.items():
        sent.clear()
        entries = [Entry(f"t{i}", "param", 6, torch.arange(6, dtype=torch.float32) + i + offset) for i in range(k)]
        if pattern == "failed" and rank == world - 1:
            report_failure(entries, group=None, device=_CPU)
        else:
            compare_replicas(entries, group=None, device=_CPU)
        out[pattern] = sum(sent)
    out["others"] = others
    return out


def test_bytes_per_rank_do_not_depend_on_the_world_size(tmp_path) -> None:
    k = 40
    by_world = {w: run_ranks(_volume, tmp_path, world_size=w, args=(k,), timeout=120) for w in (2, 4, 8)}
    for w, results in by_world.items():
        assert all(r == results[0] for r in results), f"ranks passed different volumes at W={w}: {results}"
        assert results[0]["others"] == [], f"only all_reduce may be called, got {results[0]['others']} at W={w}"
    first = {w: results[0] for w, results in by_world.items()}
    steady = 8 * 2 * 4 * (k + 1)  # the one all_reduce(MAX) of [rows, -rows]
    for pattern in ("identical", "last rank", "failed"):
        assert first[2][pattern] == first[4][pattern] == first[8][pattern], (pattern, first)
    assert first[8]["identical"] == steady
    assert first[8]["last rank"] <= steady + 8 * k * (4 + 1 + 1)  # rank 0's rows, their holders, the odd rank
    # Every rank apart takes every candidate round and names EXAMPLES ranks, a bound that holds for any W.
    bound = steady + 8 * k * (4 + 1 + (CANDIDATES - 1) * (1 + 4 + 1) + EXAMPLES)
    assert all(first[w]["all apart"] <= bound for w in first), (bound, first)
