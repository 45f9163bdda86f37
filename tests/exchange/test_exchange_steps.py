"""The exchange's per-step counters and the report's figures: reduced across the ranks, they give what a look at
every rank's record gives (checked against a direct per-rank computation), and they name the odd ranks with
bounded examples at any world size."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks
from handbuilt import P, model_info

from ddp_doctor.analyze import analyze_summary
from ddp_doctor.core.figures import MAX_PATTERNS, STATES
from ddp_doctor.core.records import TIMING_COLUMNS, ModelInfo, RankRecord, StepCounters
from ddp_doctor.doctor.pipeline import analyze
from ddp_doctor.exchange import EXAMPLES
from ddp_doctor.exchange.runner import exchange
from ddp_doctor.observation.gradscaler import encode

STEPS = 4
_KEYS = list(STATES)


def _record(
    rank: int,
    *,
    seed: int | None = None,
    counters: dict[str, list[int]] | None = None,
    sites: dict[str, list[str]] | None = None,
) -> RankRecord:
    """A clean rank; with `seed`, random usage, frozen flags, module runs and fingerprints (a few NaN)."""
    used = torch.ones(STEPS, P, dtype=torch.bool)
    ran = used.clone()
    trainable = torch.ones(STEPS, P, dtype=torch.bool)
    grad = torch.arange(STEPS * P * 2, dtype=torch.float64).reshape(STEPS, P, 2)
    weight = torch.arange((STEPS + 1) * P * 2, dtype=torch.float64).reshape(STEPS + 1, P, 2)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        used = torch.rand(STEPS, P, generator=g) < 0.7
        ran = used | (torch.rand(STEPS, P, generator=g) < 0.5)
        trainable = torch.rand(STEPS, P, generator=g) < 0.9
        grad = grad + (torch.rand(STEPS, P, 2, generator=g) < 0.3) * torch.rand(STEPS, P, 2, generator=g)
        weight = weight + (torch.rand(STEPS + 1, P, 2, generator=g) < 0.2) * torch.rand(STEPS + 1, P, 2, generator=g)
        grad[torch.rand(STEPS, P, 2, generator=g) < 0.05] = float("nan")
        if rank == 1:
            weight[2, 1, 0] = float("nan")  # one weight NaN on one rank: that step's gap is infinite
    c = StepCounters(
        ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1, batch_size=8, batchnorm_training=1
    )
    table = torch.tensor([c.as_list()] * STEPS)
    for name, values in (counters or {}).items():
        table[:, StepCounters.FIELDS.index(name)] = torch.tensor(values)
    return RankRecord(
        rank=rank,
        used=used,
        reachable=used.clone(),
        ran=ran,
        trainable=trainable,
        grad_fp=grad,
        weight_fp=weight,
        buffer_fp=torch.zeros(STEPS, 1, 2, dtype=torch.float64),
        input_fp=torch.full((STEPS, 2), float(rank + 1), dtype=torch.float64),
        timing=torch.full((STEPS, TIMING_COLUMNS), 0.01, dtype=torch.float64),
        counters=table,
        **(sites or {}),
    )


# ------------------------------------------------------------------- the figures, against every rank's record


def _direct_patterns(info: ModelInfo, records: list[RankRecord], tracked: torch.Tensor) -> dict[tuple, list[int]]:
    """Each distinct per-rank grid of cell states, computed from the records themselves."""
    ignored = torch.tensor(info.ignored)
    out: dict[tuple, list[int]] = {}
    for r in records:
        state = torch.full((STEPS, P), _KEYS.index("N"))
        state[r.ran & ~r.used] = _KEYS.index("B")
        state[r.used] = _KEYS.index("U")
        state[~r.trainable] = _KEYS.index("F")
        state[r.trainable != tracked] = _KEYS.index("X")
        state[:, ignored] = _KEYS.index("I")
        cells = tuple("".join(_KEYS[c] for c in row) for row in state.T.tolist())
        out.setdefault(cells, []).append(r.rank)
    return out


def _direct_gaps(fp: torch.Tensor, keep: torch.Tensor) -> tuple[list[float], list[int]]:
    ref = fp[:1]
    one_nan = fp.isnan() ^ ref.isnan()
    diff = (fp - ref).abs().masked_fill(fp.isnan() | ref.isnan(), 0.0).amax(-1).amax(0)
    return diff.masked_fill(~keep, 0.0).amax(-1).tolist(), (one_nan.any(-1).any(0) & keep).sum(-1).tolist()


@pytest.mark.parametrize("world", [2, 3, 6])
def test_figures_equal_a_direct_look_at_every_rank(world: int) -> None:
    info = model_info()
    records = [_record(r, seed=100 * world + r) for r in range(world)]
    d = analyze(info, records)
    assert d.usage_map is not None and d.divergence is not None
    tracked = torch.tensor(info.trainable_at_wrap)
    got = {tuple(p.cells): p.ranks for p in d.usage_map.patterns}
    assert got == _direct_patterns(info, records, tracked)
    assert d.usage_map.patterns[0].ranks[0] == 0
    kept = ~torch.tensor(info.ignored)
    weights, w_missing = _direct_gaps(torch.stack([r.weight_fp for r in records]), kept.expand(STEPS + 1, -1))
    trained = torch.stack([r.trainable for r in records]).all(0) & kept
    grads, g_missing = _direct_gaps(torch.stack([r.grad_fp for r in records]), trained)
    assert d.divergence.weights == [float("inf") if m else w for w, m in zip(weights, w_missing)]
    assert d.divergence.grads == grads
    assert d.divergence.grads_missing == g_missing


def test_the_usage_map_keeps_rank_zeros_pattern_and_counts_the_ranks_beyond_the_limit() -> None:
    world = MAX_PATTERNS + 4
    records = [_record(r, seed=r) for r in range(world)]
    d = analyze(model_info(), records)
    shown = [r for p in d.usage_map.patterns for r in p.ranks]
    assert len(d.usage_map.patterns) == MAX_PATTERNS and d.usage_map.patterns[0].ranks[0] == 0
    assert sorted(shown + d.usage_map.ranks_omitted) == list(range(world))


# ------------------------------------------------------------------- per-step counters name the odd ranks


def _odd(
    world: int,
    extra: set[int],
    colls: set[int],
    scales: set[int],
    evals: frozenset[int] = frozenset(),
    eval_step: int = 2,
) -> list[RankRecord]:
    out = []
    for r in range(world):
        # A rank that evaluates through DDP without grad broadcasts there, and its next training forward does not.
        evaluated = [int(r in evals and s == eval_step) for s in range(STEPS)]
        counters = {
            "unpaired_forwards": [0, 1 if r in extra else 0, 0, 0],
            "ddp_broadcasts": [1] * STEPS,
            "eval_broadcasts": evaluated,
            "collectives": [1, 1, 2 if r in colls else 1, 1],
            "collective_digest": [7, 7, 9 if r in colls else 8, 7],
            "scaler_scale": [encode(1024.0), encode(512.0 if r in scales else 1024.0), encode(1024.0), encode(1024.0)],
        }
        log = ["step 2: all_reduce(float32[1], SUM)/2 at train.py:40"]
        if r in colls:
            log.append("step 2: broadcast(int64[3])/2 at train.py:41")
        sites = {
            "unpaired_sites": ["step 1: train.py:55"] if r in extra else [],
            "broadcast_sites": [f"step {eval_step}: eval.py:30"] if r in evals else [],
            "collective_log": log,
        }
        out.append(_record(r, counters=counters, sites=sites))
    return out


def _by_kind(d, code: str, kind: str):
    """The finding of `code` of `kind` (its `labels`): a `collective-mismatch`'s mechanism."""
    return next(f for f in d.findings if f.code == code and f.labels.get("kind") == kind)


def test_unpaired_forwards_collectives_and_scales_name_the_ranks() -> None:
    d = analyze(model_info(), _odd(8, extra={2, 5}, colls={3}, scales={6}))
    unpaired = _by_kind(d, "collective-mismatch", "forward-without-backward")
    assert (unpaired.ranks, unpaired.steps, unpaired.sites) == ([2, 5], [1], ["train.py:55"])
    assert unpaired.severity == "error"  # the model has buffers and broadcasts them
    coll = _by_kind(d, "collective-mismatch", "sequence")
    assert (coll.ranks, coll.steps, coll.sites) == ([0, 3], [2], ["train.py:41"])  # rank 3 against rank 0
    # What rank 3 called there: not in the evidence.
    assert "rank 3 called broadcast(int64[3]) over a group of 2" in coll.detail
    scaler = next(f for f in d.findings if f.code == "grad-scaler-mismatch")
    # Rank 6's scale against rank 0's at step 1, the first step they differ.
    assert (scaler.ranks, scaler.steps) == ([0, 6], [1]), scaler
    assert {m.name: (m.value, m.unit) for m in scaler.measured} == {
        "scale (rank 0)": (1024.0, "ratio"),
        "scale (rank 6)": (512.0, "ratio"),
    }, scaler.measured
    bn = next(f for f in d.findings if f.code == "batchnorm-not-synced")
    assert bn.ranks == list(range(8)), bn
    assert {m.name: (m.value, m.unit) for m in bn.measured} == {
        "samples_per_rank": (8, "count"),
        "batchnorm_layers": (1, "count"),
    }, bn.measured


def test_a_buffer_broadcast_from_a_forward_without_grad_on_some_ranks_names_them_and_the_line() -> None:
    d = analyze(model_info(), _odd(8, extra=set(), colls=set(), scales=set(), evals=frozenset({0, 4})))
    found = _by_kind(d, "collective-mismatch", "broadcast-without-grad")
    # Ranks 0 and 4 and no others (ranks 1-3, 5-7 did not), at eval.py:30 in step 2.
    assert found.severity == "error" and (found.ranks, found.more_ranks) == ([0, 4], 0), found
    assert (found.steps, found.sites) == ([2], ["eval.py:30"]), found
    assert "ddp_model.module(x)" in found.fix and "every rank" in found.fix
    # Every rank broadcast once per step (the evaluation took over the next forward's): no count sentence.
    assert "different numbers of buffer broadcasts" not in found.detail


def test_a_step_whose_grad_mode_forwards_without_backward_differ_is_reported_once() -> None:
    d = analyze(model_info(), _odd(4, extra={2}, colls=set(), scales=set(), evals=frozenset({2}), eval_step=1))
    # One finding, the forward without backward's (at train.py:55), not also the broadcast's (at eval.py:30).
    assert [(f.ranks, f.steps, f.sites) for f in d.findings if f.code == "collective-mismatch"] == [
        ([2], [1], ["train.py:55"])
    ]
    assert _by_kind(d, "collective-mismatch", "forward-without-backward").sites == ["train.py:55"]


def test_the_same_evaluation_on_every_rank_is_no_finding() -> None:
    d = analyze(model_info(), _odd(4, extra=set(), colls=set(), scales=set(), evals=frozenset(range(4))))
    assert not [f for f in d.findings if f.code == "collective-mismatch"], d.findings


def test_many_odd_ranks_are_named_by_examples_and_counted() -> None:
    world = 40
    extra = set(range(1, world, 2))
    d = analyze(model_info(), _odd(world, extra=extra, colls=extra, scales=extra))
    unpaired = _by_kind(d, "collective-mismatch", "forward-without-backward")
    assert len(unpaired.ranks) == EXAMPLES and set(unpaired.ranks) <= extra
    assert unpaired.more_ranks == len(extra) - EXAMPLES
    coll = _by_kind(d, "collective-mismatch", "sequence")
    assert coll.more_ranks == len(extra) - EXAMPLES
    scaler = next(f for f in d.findings if f.code == "grad-scaler-mismatch")
    # Rank 0 and examples of the others, the rest counted: every odd rank is accounted for.
    assert scaler.ranks[0] == 0 and set(scaler.ranks[1:]) <= extra
    assert len(scaler.ranks[1:]) + scaler.more_ranks == len(extra), (scaler.ranks, scaler.more_ranks)


def _real(rank: int, world: int) -> dict:
    records = _odd(world, extra={2, 5}, colls={3}, scales={6}, evals=frozenset({4}))
    summary = exchange(records[rank], model_info(), timeout=20, tag="c", device=torch.device("cpu"))
    d = analyze_summary(summary)
    model = analyze(model_info(), records)
    return {
        "real": [f.to_dict() for f in d.findings],
        "model": [f.to_dict() for f in model.findings],
        "usage": d.usage_map.to_dict(),
        "model_usage": model.usage_map.to_dict(),
    }


def test_a_real_group_of_8_agrees_with_the_model(tmp_path) -> None:
    results = run_ranks(_real, tmp_path, world_size=8, timeout=120)
    for r in results:
        assert r["real"] == results[0]["real"] == r["model"]
        assert r["usage"] == r["model_usage"]
    assert {f["code"] for f in results[0]["real"]} >= {"collective-mismatch", "grad-scaler-mismatch"}
    # Rank 4's broadcast of DDP's buffers from its evaluation at eval.py:30 in step 2.
    assert any(
        (f["code"], f["ranks"], f["steps"], f["sites"]) == ("collective-mismatch", [4], [2], ["eval.py:30"])
        for f in results[0]["real"]
    ), results[0]["real"]
