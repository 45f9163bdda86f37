"""The benchmarks' synthetic inputs stay valid as the records change (scale.py's records once lagged a new timing
column and the benchmark crashed unnoticed). In one process: the exchange's model, not a process group."""

from __future__ import annotations

import sys

from checkrun import REPO

from ddp_doctor.exchange import summarize


def test_the_scale_benchmarks_job_runs_through_the_exchange_model_and_the_analysis() -> None:
    sys.path.insert(0, str(REPO))
    from benchmarks.scale import _clean, _codes, before_bytes, make_info, make_record

    world, params = 8, 300
    clean = _clean(params)
    summary = summarize(make_info(params), [make_record(r, world, params, clean) for r in range(world)])
    # The job's two planted faults: one rank never uses a parameter, another one's weights diverge after step 5.
    assert _codes(summary) == ["rank-dependent-graph", "replica-divergence"]
    assert summary.volume.collectives > 0 and summary.volume.sent < 100_000
    # the replaced all_gather exchange the benchmark compares against: every rank receives every record
    before = before_bytes(world, params)
    assert before["received"] == world * before["sent"] > summary.volume.sent
