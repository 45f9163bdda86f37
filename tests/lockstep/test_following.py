"""Epoch following below the launcher: the projection of capped passes, the exchange over 4 real gloo ranks (who
worked alone, the loaders' real lengths by rank, counts that differ), the findings' thresholds, and the report's
`following` section in JSON, text and HTML."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from dist import run_ranks
from handbuilt import follow_case
from handbuilt import follow_record as record

from ddp_doctor.analyze.following_ends import NO_LOADER, following_findings, following_section
from ddp_doctor.core.findings import Recommendation, Timing
from ddp_doctor.core.following import AloneSpan, FollowSummary
from ddp_doctor.exchange.following_rounds import exchange_follow, follow_rounds, projected_gaps
from ddp_doctor.exchange.simulate import lockstep
from ddp_doctor.report.model import Report


def test_a_capped_pass_inside_a_gap_is_projected_to_its_real_length() -> None:
    gaps, projected, known, shown = projected_gaps(record(0, alone=True))
    assert abs(gaps[1] - 0.64) < 1e-9
    assert abs(projected[1] - (0.64 + 0.5 * 199)) < 1e-6 and known == [True, True]
    assert shown[1] == ["train.py:40: 2 of 400 batches, 0.50 s"]
    no_len = record(0, alone=True)
    no_len.passes[0]["batches"] = None
    assert projected_gaps(no_len)[2] == [True, False]


def _exchange(rank: int, world: int, case: str) -> dict:
    s = exchange_follow(follow_case(rank, case, 2 if case == "alone" else 3), timeout=30.0, device=torch.device("cpu"))
    return _said(s)


def _said(s: FollowSummary) -> dict:
    a = s.alone
    return {
        "alone": None
        if a is None
        else {"rank": a.rank, "measured": a.measured_s, "projected": a.projected_s, "end": a.end, "passes": a.passes},
        "loaders": s.loaders,
        "more": s.more_ranks,
        "counts": s.counts,
    }


def test_the_exchange_names_the_rank_that_worked_alone_and_every_loader(tmp_path: Path) -> None:
    results = run_ranks(_exchange, tmp_path, world_size=4, args=("alone",), timeout=120)
    assert all(r == results[0] for r in results)  # identical on every rank
    alone = results[0]["alone"]
    assert alone["rank"] == 2 and abs(alone["measured"] - 0.55) < 1e-6, alone
    assert abs(alone["projected"] - (0.55 + 0.5 * 199)) < 1e-6, alone
    assert alone["passes"] == ["train.py:40: 2 of 400 batches, 0.50 s"], alone
    assert "train.py:20" in alone["end"], alone
    train, evaluation = results[0]["loaders"]
    assert train["batches"] == {"min": 30, "max": 33, "by_rank": [30, 31, 32, 33]} and train["training"], train
    assert evaluation["batches"]["by_rank"] == [None, None, 400, None] and not evaluation["training"], evaluation


def test_the_exchange_names_the_ranks_with_more_collectives(tmp_path: Path) -> None:
    results = run_ranks(_exchange, tmp_path, world_size=4, args=("counts",), timeout=120)
    assert results[0]["more"] == [3] and results[0]["counts"]["collective"] == (1, 0), results[0]
    assert results[0]["alone"] is None


def test_the_followings_rounds_name_the_same_ranks_among_1024_in_the_volume_of_64() -> None:
    """`follow_rounds` run for every rank at once (`simulate.lockstep`): rank 700 alone in an evaluation, then rank
    1000 with one collective more; what each rank sends does not grow with the world size."""
    said, volumes = {}, {}
    for world, odd in ((64, 40), (1024, 700)):
        got, volume = lockstep([follow_rounds(follow_case(w, "alone", odd), rank=w, world=world) for w in range(world)])
        said[world], volumes[world] = _said(got), (volume.sent, volume.collectives)
    alone = said[1024]["alone"]
    assert alone["rank"] == 700 and abs(alone["measured"] - 0.55) < 1e-6, alone
    train, evaluation = said[1024]["loaders"]
    assert train["batches"] == {"min": 30, "max": 1053, "by_rank": list(range(30, 38))}, train
    assert evaluation["batches"]["by_rank"] == [None] * 8, evaluation  # held by rank 700 alone, past the first 8
    assert volumes[64] == volumes[1024], volumes
    counts, _ = lockstep([follow_rounds(follow_case(w, "counts", 1000), rank=w, world=1024) for w in range(1024)])
    assert counts.more_ranks == [1000] and counts.counts["collective"] == (1, 0), counts


def summary(alone: AloneSpan | None, timeout: float | None = 60.0, **kw) -> FollowSummary:
    base = {
        "followed": True,
        "declined": False,
        "epoch_ends": 1,
        "ended_by": "the next epoch's first step, after 1 epoch end(s)",
        "seconds": 0.7,
        "loaders": [],
        "counts": {"collective": (0, 0), "ddp-broadcast": (0, 0), "ddp-step": (2, 2)},
        "alone": alone,
        "timeout_s": timeout,
    }
    return FollowSummary(**{**base, **kw})


def span(measured: float, projected: float | None) -> AloneSpan:
    return AloneSpan(
        rank=0,
        measured_s=measured,
        projected_s=projected,
        start="the end of the observed steps",
        end="DDP's gradient all-reduce after the forward at train.py:20",
        passes=["train.py:40: 2 of 400"],
    )


def test_timeout_risk_is_an_error_at_the_timeout_a_warning_at_half_and_nothing_below() -> None:
    assert [f.severity for f in following_findings(summary(span(0.5, 100.0)))] == ["error"]
    assert [f.severity for f in following_findings(summary(span(0.5, 40.0)))] == ["warning"]
    assert following_findings(summary(span(0.5, 20.0))) == []
    # Without a length the measured span alone is compared: no projection is measured.
    [unknown] = following_findings(summary(span(45.0, None)))
    assert unknown.severity == "warning" and [m.name for m in unknown.measured] == ["alone", "group_timeout"]
    assert unknown.labels == {
        "start": "the end of the observed steps",
        "end": "DDP's gradient all-reduce after the forward at train.py:20",
        "passes": "train.py:40: 2 of 400",
    }
    assert following_findings(summary(span(0.5, 100.0), timeout=None)) == []  # no timeout known, no claim


def test_counts_that_differ_and_a_lone_broadcast_are_collective_mismatch() -> None:
    [counts] = following_findings(
        summary(None, counts={"collective": (1, 0), "ddp-broadcast": (0, 0), "ddp-step": (2, 2)}, more_ranks=[3])
    )
    assert counts.code == "collective-mismatch" and counts.ranks == [3] and "0 to 1" in counts.detail
    [lone] = following_findings(summary(None, more_ranks=[0], extra_sites=["eval.py:12"], lone_broadcasts=True))
    assert "eval.py:12" in lone.title and "ddp_model.module" in lone.fix


def test_the_following_section_says_what_was_followed_in_json_text_and_html() -> None:
    loaders = [
        {
            "site": "train.py:10",
            "sampler": "DistributedSampler",
            "training": True,
            "passes": 2,
            "most": 8,
            "capped": 1,
            "batches": {"min": 30, "max": 33, "by_rank": [30, 31]},
        }
    ]
    section = following_section(summary(None, loaders=loaders), epochs=1, limit=2)
    report = Report(
        tool_version="0.1.0",
        torch_version=torch.__version__,
        backend="gloo",
        world_size=2,
        steps_observed=8,
        ddp_config={"find_unused_parameters": False, "static_graph": False},
        findings=[],
        recommendation=Recommendation(
            find_unused_parameters=False,
            static_graph=False,
            gradient_as_bucket_view=False,
            freeze_before_wrap=[],
            reason="every parameter got a gradient",
            verified=True,
        ),
        timing=Timing(),
    )
    report = dataclasses.replace(report, following=section)
    again = Report.from_dict(json.loads(report.to_json()))
    assert again.following == section and list(json.loads(report.to_json()))[-1] == "following"
    text = str(report)
    assert "followed 1 epoch end(s)" in text and "real length 30-33 batches by rank" in text, text
    assert "real length 30-33 batches by rank" in report.to_html()
    declined = following_section(summary(None, followed=False, declined=True), epochs=1, limit=2)
    assert declined.note == NO_LOADER
    assert following_section(summary(None, followed=False), epochs=1, limit=2) is None  # the steps never ended
