"""The check's exchange: reductions whose volume does not grow with the world size, and a second round that names
the ranks that differ. Real gloo groups of 8 ranks, and the in-process model of the same protocol."""

from __future__ import annotations

import pytest
import torch
from dist import run_ranks

from ddp_doctor import ReportTimeoutError
from ddp_doctor.analyze import analyze_summary
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import rank_list, rank_ranges
from ddp_doctor.core.records import CRASH_KINDS, TIMING_COLUMNS, ModelInfo, RankRecord, StepCounters
from ddp_doctor.doctor.pipeline import analyze
from ddp_doctor.exchange import EXAMPLES, summarize
from ddp_doctor.exchange.runner import exchange
from ddp_doctor.report.model import Report, RunFacts
from ddp_doctor.report.text import to_text

NAMES = ["trunk.weight", "trunk.bias", "head_a.weight", "head_b.weight"]
STEPS = 3


def _info() -> ModelInfo:
    return ModelInfo(
        param_names=NAMES,
        param_shapes=[(4, 3), (4,), (2, 4), (2, 4)],
        trainable_at_wrap=[True] * 4,
        ignored=[False] * 4,
        buffer_names=[],
        buffer_shapes=[],
        ddp_config={"find_unused_parameters": False, "static_graph": False},
    )


def _record(
    rank: int, *, lacks: set[int] = frozenset(), diverged: set[int] = frozenset(), crashed: set[int] = frozenset()
) -> RankRecord:
    """A clean rank, except: ranks in `lacks` never use head_b; ranks in `diverged` end step 1 with other trunk
    weights; ranks in `crashed` stop in step 2 with DDP's reduction error."""
    used = torch.ones(STEPS, 4, dtype=torch.bool)
    if rank in lacks:
        used[:, 3] = False
    weights = torch.arange((STEPS + 1) * 4 * 2, dtype=torch.float64).reshape(STEPS + 1, 4, 2)
    if rank in diverged:
        weights[2:, 0] += 0.5
    c = StepCounters(ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1)
    counters = torch.tensor([c.as_list()] * STEPS)
    crash = {}
    if rank in crashed:
        counters[2, StepCounters.FIELDS.index("complete")] = 0
        crash = {
            "crash_kind": CRASH_KINDS.index("reduction-error"),
            "crash_step": 2,
            "crash_message": f"Expected to have finished reduction in the prior iteration (rank {rank})",
        }
    return RankRecord(
        rank=rank,
        used=used,
        reachable=used.clone(),
        ran=used.clone(),
        trainable=torch.ones(STEPS, 4, dtype=torch.bool),
        grad_fp=torch.arange(STEPS * 4 * 2, dtype=torch.float64).reshape(STEPS, 4, 2),
        weight_fp=weights,
        buffer_fp=torch.zeros(STEPS, 0, 2, dtype=torch.float64),
        input_fp=torch.full((STEPS, 2), float(rank + 1), dtype=torch.float64),
        timing=torch.full((STEPS, TIMING_COLUMNS), 0.01 * (rank + 1), dtype=torch.float64),
        counters=counters,
        **crash,
    )


ODD = {"lacks": {3}, "diverged": {5}}


def _diagnose(rank: int, world: int) -> dict:
    summary = exchange(_record(rank, **ODD), _info(), timeout=20, tag="x", device=torch.device("cpu"))
    d = analyze_summary(summary)
    # The in-process model of the same protocol, on every rank's record: the same diagnosis and the same bytes.
    local = summarize(_info(), [_record(r, **ODD) for r in range(world)])
    model = analyze(_info(), [_record(r, **ODD) for r in range(world)])
    return {
        "findings": [f.to_dict() for f in d.findings],
        "model": [f.to_dict() for f in model.findings],
        "timing": d.timing.to_dict(),
        "model_timing": model.timing.to_dict(),
        "sent": summary.volume.sent,
        "model_sent": local.volume.sent,
        "rounds": summary.volume.rounds,
        "model_rounds": local.volume.rounds,
    }


def test_second_round_names_the_rank_with_another_used_set_and_the_diverged_one(tmp_path) -> None:
    results = run_ranks(_diagnose, tmp_path, world_size=8, timeout=120)
    first = results[0]
    assert all(r["findings"] == first["findings"] for r in results)  # identical on every rank
    by_code = {f["code"]: f for f in first["findings"]}
    assert by_code["rank-dependent-graph"]["ranks"] == [3]
    assert by_code["rank-dependent-graph"]["params"][0]["name"] == "head_b.weight"
    assert by_code["replica-divergence"]["ranks"] == [0, 5]
    assert [p["name"] for p in by_code["replica-divergence"]["params"]] == ["trunk.weight"]
    assert by_code["replica-divergence"]["steps"] == [1, 2]
    assert "more_ranks" not in by_code["replica-divergence"]
    # The model of the code path computes what the process group computed.
    assert first["model"] == first["findings"] and first["model_timing"] == first["timing"]
    assert first["model_sent"] == first["sent"] and first["model_rounds"] == first["rounds"]
    # The exact median of 24 step times (0.01 .. 0.08 s per phase, three phases).
    assert first["timing"]["step_s"] == pytest.approx(0.135)


def _missing(rank: int, world: int) -> str:
    if rank == 6:
        return "left"
    with pytest.raises(ReportTimeoutError) as info:
        exchange(_record(rank), _info(), timeout=3, tag="m", device=torch.device("cpu"))
    return str(info.value)


def test_a_rank_that_never_comes_is_named(tmp_path) -> None:
    results = run_ranks(_missing, tmp_path, world_size=8, timeout=120)
    assert results[6] == "left"
    assert all("rank(s) [6]" in m for r, m in enumerate(results) if r != 6)


def _crashes(rank: int, world: int) -> list:
    summary = exchange(_record(rank, crashed={1, 2}), _info(), timeout=20, tag="c", device=torch.device("cpu"))
    d = analyze_summary(summary)
    return [[f.code, f.ranks] for f in d.findings] + [[c.rank, c.message] for c in d.crashes]


def test_crashed_ranks_and_their_messages_come_from_those_ranks(tmp_path) -> None:
    a, *rest = run_ranks(_crashes, tmp_path, world_size=8, timeout=120)
    assert all(r == a for r in rest)
    assert ["reduction-error", [1, 2]] in a
    assert [1, "Expected to have finished reduction in the prior iteration (rank 1)"] in a
    assert [2, "Expected to have finished reduction in the prior iteration (rank 2)"] in a


# ----------------------------------------------------------------------------------- the model at large sizes


def _many(world: int, **odd: set[int]) -> list[RankRecord]:
    clean = _record(0)
    out = []
    for r in range(world):
        if any(r in v for v in odd.values()):
            out.append(_record(r, **odd))
        else:  # share the tensors: only the rank differs
            rec = RankRecord(**{**clean.__dict__, "rank": r})
            rec.input_fp = torch.full((STEPS, 2), float(r + 1), dtype=torch.float64)
            out.append(rec)
    return out


def test_large_world_names_examples_and_counts_the_rest() -> None:
    lacking = set(range(0, 200, 3))
    d = analyze(_info(), _many(200, lacks=lacking, diverged={7, 150}))
    f = next(f for f in d.findings if f.code == "rank-dependent-graph")
    assert len(f.ranks) == EXAMPLES and set(f.ranks) <= lacking
    assert len(f.ranks) + f.more_ranks == len(lacking)
    assert f.to_dict()["more_ranks"] == len(lacking) - EXAMPLES
    div = next(f for f in d.findings if f.code == "replica-divergence")
    assert div.ranks == [0, 7, 150] and div.more_ranks == 0


def _wide(world: int, params: int = 300) -> tuple[ModelInfo, list[RankRecord]]:
    """A 300-tensor model on `world` ranks (shared tensors), rank 1 never using one parameter."""
    info = ModelInfo(
        param_names=[f"layer{i}.weight" for i in range(params)],
        param_shapes=[(8,)] * params,
        trainable_at_wrap=[True] * params,
        ignored=[False] * params,
        buffer_names=[],
        buffer_shapes=[],
        ddp_config={},
    )
    used = torch.ones(STEPS, params, dtype=torch.bool)
    odd = used.clone()
    odd[:, 5] = False
    c = StepCounters(ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1)
    shared = {
        "reachable": used,
        "ran": used,
        "trainable": used,
        "grad_fp": torch.randn(STEPS, params, 2, dtype=torch.float64),
        "weight_fp": torch.randn(STEPS + 1, params, 2, dtype=torch.float64),
        "buffer_fp": torch.zeros(STEPS, 0, 2, dtype=torch.float64),
        "counters": torch.tensor([c.as_list()] * STEPS),
    }
    return info, [
        RankRecord(
            rank=r,
            used=odd if r == 1 else used,
            **shared,
            input_fp=torch.full((STEPS, 2), float(r + 1), dtype=torch.float64),
            timing=torch.rand(STEPS, TIMING_COLUMNS, dtype=torch.float64),
        )
        for r in range(world)
    ]


def test_the_volume_does_not_grow_with_the_world_size() -> None:
    small = summarize(*_wide(2)).volume
    large = summarize(*_wide(300)).volume
    assert large.collectives == small.collectives
    # The step phases too: a few ranks' rows and reductions, no row per rank (it was ROW_SIZE float64 per rank).
    assert large.sent <= 1.5 * small.sent, (small.rounds, large.rounds)


# 30 s alone on 2 cores, 40 s beside a second pytest-xdist worker, 81 s with more runs beside it: room over the 120 s default.
@pytest.mark.timeout(240)
def test_the_report_stays_readable_at_large_world_sizes() -> None:
    records = _many(1024, lacks=set(range(1024)) - {512})
    info = _info()
    d = analyze(info, records)
    text = to_text(Report.build(RunFacts.of_model(info, world_size=1024, backend="gloo"), d))
    assert "seen: ranks 0-7 and 1015 others; steps [0, 1, 2]" in text
    assert max(line.count(",") for line in text.splitlines()) < 20


def test_rank_ranges() -> None:
    assert rank_ranges([*range(512), *range(513, 1024)]) == "0-511, 513-1023"
    assert rank_ranges([0, 1]) == "0, 1"
    assert rank_ranges([3, 17, 250], more=41) == "3, 17, 250 and 41 others"
    assert rank_ranges(range(0, 40, 2), limit=3) == "0, 2, 4 and 17 more ranges"
    assert rank_list([5]) == "rank 5" and rank_list([1, 2, 3]) == "ranks 1-3"
    assert Finding(code="rank-hung", severity="error", title="t", detail="d").to_dict().get("more_ranks") is None


def test_rank_zeros_model_info_speaks_for_the_group_when_the_ranks_differ() -> None:
    """Names and shapes are checked before (layout hash); other fields travel once, from rank 0, when they differ."""
    from dataclasses import replace

    infos = [_info(), replace(_info(), ddp_site="other.py:1"), replace(_info(), ddp_site="other.py:2")]
    infos[0].ddp_site = "train.py:10"
    small = summarize(infos[0], [_record(r) for r in range(3)])
    mixed = summarize(infos[0], [_record(r) for r in range(3)], infos=infos)
    assert mixed.info.ddp_site == "train.py:10"
    assert mixed.volume.collectives == small.volume.collectives + 1


@pytest.mark.parametrize("world", [4, 1024])
def test_trainable_sets_that_differ_at_the_wrap_are_counted_per_parameter_with_a_rank_on_each_side(world: int) -> None:
    """Ranks 1 and `world - 1` hand DDP head_b instead of head_a (the same shape): a count and two ranks per
    parameter, in one SUM and one MAX whose shapes do not depend on the world size."""
    from dataclasses import replace

    swapped = replace(_info(), trainable_at_wrap=[True, True, False, True])
    infos = [_info() if r not in (1, world - 1) else swapped for r in range(world)]
    infos[0] = replace(_info(), trainable_at_wrap=[True, True, True, False])
    infos = [infos[0] if i is not swapped else swapped for i in infos]
    records = [_record(r) for r in range(world)]
    same = summarize(infos[0], records)
    apart = summarize(infos[0], records, infos=infos)
    assert same.wrap_trainable is None
    assert apart.wrap_trainable.tolist() == [[world, 0, -1], [world, 0, -1], [world - 2, 0, 1], [2, 1, 0]]
    # Rank 0's ModelInfo travels too (its trainable set is part of it), then the counts and the lowest ranks.
    assert apart.volume.collectives == same.volume.collectives + 3
    findings = [f for f in analyze_summary(apart).findings if f.code == "param-shapes-differ"]
    assert [(f.param_names, f.ranks) for f in findings] == [(["head_a.weight", "head_b.weight"], [0, 1])]


def test_a_1024_rank_hang_names_a_handful_of_ranks_per_line() -> None:
    """The findings of a run whose ranks could not exchange (built from the ranks' files) stay short too."""
    from ddp_doctor.analyze.failures import failure_findings
    from ddp_doctor.core.rankstate import RankState

    states = {
        r: RankState(
            rank=r, world_size=1024, step=3 if r != 700 else 2, phase="backward", site=f"train.py:{40 + r % 3}"
        )
        for r in range(1024)
    }
    from ddp_doctor.report.words import worded

    (hung,) = failure_findings(states, timed_out=True)
    assert hung.code == "rank-hung" and hung.ranks == [700]
    assert len(hung.positions) == 8 and hung.measured[0].value == 1024  # the evidence: 8 positions, the rest counted
    detail = worded(hung).detail
    assert "and 1016 other ranks" in detail and detail.count("rank ") < 12


def _mismatch(rank: int, world: int) -> str:
    from ddp_doctor import RankMismatchError

    names = NAMES if rank == 0 else [*NAMES, "extra.weight"]
    info = ModelInfo(
        param_names=names,
        param_shapes=[(2,)] * len(names),
        trainable_at_wrap=[True] * len(names),
        ignored=[False] * len(names),
        buffer_names=[],
        buffer_shapes=[],
        ddp_config={},
    )
    with pytest.raises(RankMismatchError) as raised:
        exchange(RankRecord.empty(rank, len(names), 0), info, timeout=10, tag="mm", device=torch.device("cpu"))
    return str(raised.value)


def test_different_parameter_lists_raise_on_every_rank_before_the_exchange(tmp_path) -> None:
    messages = run_ranks(_mismatch, tmp_path)
    assert all("rank 0: 4 params" in m and "rank 1: 5 params" in m for m in messages)
