"""input-bound and straggler-rank on hand-built records: each rule fires on a large, consistent effect, and not on
a small one, an inconsistent one, or one the other ranks do not pay for. Timing rows are
(forward, backward incl. the all-reduce wait, optimizer, wait for data, all-reduce wait) in seconds."""

from __future__ import annotations

import json

import pytest
import torch
from purerecords import info, no_distributed, record  # noqa: F401 (the fixture: no collective in analyze)

from ddp_doctor.analyze.throughput import MIN_WAIT_S
from ddp_doctor.core.records import RankRecord
from ddp_doctor.doctor.pipeline import analyze
from ddp_doctor.report import Report, RunFacts
from ddp_doctor.report.text import to_text

STEPS = 8
ALL = [[1, 1, 1, 1]] * STEPS
MS = 1e-3
LOADER = {
    "batches": 64,
    "sampler": "DistributedSampler",
    "padded": 0,
    "dataset": 1024,
    "dataset_type": "SlowDecode",
    "num_workers": 0,
    "pin_memory": False,
    "persistent_workers": False,
    "batch_size": 8,
    "site": "train.py:31",
    "epochs_started": 1,
    "epochs_seen": [0],
    "first_step": 0,
}


def timed(rank: int, rows: list[tuple[float, ...]], loaders=()) -> RankRecord:
    """A clean rank whose step `s` took `rows[s]` (in ms; the first step's data wait is unknown, NaN)."""
    r = record(rank, [[1, 1, 1, 1]] * len(rows))
    t = torch.tensor(rows, dtype=torch.float64) * MS
    t[0, 3] = float("nan")
    r.timing = t
    r.loaders = [dict(d) for d in loaders]
    return r


def steady(fwd=1.0, bwd=2.0, opt=0.5, data=0.5, comm=0.5, jitter=0.05) -> list[tuple[float, ...]]:
    """`STEPS` rows around the given milliseconds, a little apart (as measured steps are)."""
    return [(fwd, bwd + comm, opt, data * (1 + jitter * (s % 3)), comm) for s in range(STEPS)]


def codes(records) -> set[str]:
    return {f.code for f in analyze(info(), records).findings}


# ------------------------------------------------------------------------------------------------ input-bound


def test_input_bound_names_the_loader_its_settings_the_share_and_the_milliseconds() -> None:
    records = [timed(r, steady(data=20.0), loaders=[LOADER]) for r in range(2)]
    d = analyze(info(), records)
    f = next(f for f in d.findings if f.code == "input-bound")
    assert f.ranks == [0, 1] and f.severity == "warning"
    # The loader's type and settings, and the host's clock.
    assert f.labels == {"clock": "host", "dataset": "SlowDecode", "pin_memory": "False", "persistent_workers": "False"}
    got = {m.name: (m.value, m.unit) for m in f.measured}
    assert got["num_workers"] == (0, "count")
    assert got["data_wait"][1] == got["step"][1] == "s" and got["data_wait_share"][1] == "fraction"
    # The median wait and step (21.0 ms of 25.0 ms), to the report's 0.1 ms, and the share of the step.
    assert got["data_wait"][0] == pytest.approx(0.021, abs=5e-5) and got["step"][0] == pytest.approx(0.025, abs=5e-5)
    assert (
        0.5 < got["data_wait_share"][0] < 1
        and abs(got["data_wait"][0] / got["step"][0] - got["data_wait_share"][0]) < 1e-9
    )
    assert got["steps_timed"] == (STEPS - 1, "count")
    assert f.sites == ["train.py:31"]  # the loader's line
    assert "num_workers" in f.fix and "persistent_workers" in f.fix and "pin_memory" in f.fix
    # pinned memory helps a copy to a GPU only: not advised for a model on CPU
    cpu = next(f for f in analyze(info(device_type="cpu"), records).findings if f.code == "input-bound")
    assert "persistent_workers" in cpu.fix and "pin_memory" not in cpu.fix, cpu.fix


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param(steady(data=1000 * MIN_WAIT_S * 0.8, fwd=0.1, bwd=0.1, opt=0.1, comm=0.1), id="too-few-ms"),
        pytest.param(steady(data=20.0, fwd=15.0, bwd=10.0), id="small-share"),
        # A long wait in 3 steps of 8 (an epoch start, a log line): the median step does not wait.
        pytest.param([(1, 2.5, 0.5, 40.0 if s % 3 == 0 else 0.5, 0.5) for s in range(STEPS)], id="now-and-then"),
    ],
)
def test_input_bound_needs_a_large_and_consistent_wait(rows) -> None:
    assert "input-bound" not in codes([timed(r, rows, loaders=[LOADER]) for r in range(2)])


def test_input_bound_needs_a_wait_longer_than_the_spread_of_the_steps() -> None:
    """A shared machine: another job takes the cores now and then, and the steps scatter by 20 to 60 ms. The time
    between steps is over half the median step in most steps, but no longer than the steps' own spread."""
    busy = [(1.0, 2.5, 0.5, (5.0, 30.0, 70.0)[s % 3], 0.5) for s in range(STEPS)]
    records = [timed(r, busy, loaders=[LOADER]) for r in range(2)]
    assert "input-bound" not in codes(records)
    steadier = [(1.0, 2.5, 0.5, 40.0 + 5.0 * (s % 2), 0.5) for s in range(STEPS)]  # the same wait, steadily
    assert "input-bound" in codes([timed(r, steadier, loaders=[LOADER]) for r in range(2)])


def test_neither_rule_on_fewer_than_six_measured_steps() -> None:
    for observed, found in ((6, False), (7, True)):  # measured steps: the first observed one is left out
        waiting = [timed(r, steady(data=20.0)[:observed], loaders=[LOADER]) for r in range(2)]
        straggling = [timed(0, steady(comm=25.0)[:observed]), timed(1, steady(fwd=26.0, comm=0.5)[:observed])]
        assert ("input-bound" in codes(waiting)) is found and ("straggler-rank" in codes(straggling)) is found


def test_input_bound_needs_most_ranks_waiting() -> None:
    records = [timed(r, steady(data=20.0 if r == 0 else 0.5), loaders=[LOADER]) for r in range(3)]
    assert "input-bound" not in codes(records)


def test_neither_rule_runs_for_a_ddp_on_gpus_whose_host_times_do_not_tell() -> None:
    cuda = info(ddp_config={"find_unused_parameters": False, "static_graph": False, "device_ids": [0]})
    waiting = [timed(r, steady(data=20.0), loaders=[LOADER]) for r in range(2)]
    straggling = [timed(0, steady(comm=25.0)), timed(1, steady(fwd=26.0, comm=0.5)), timed(2, steady(comm=25.0))]
    assert "input-bound" in codes(waiting) and "straggler-rank" in codes(straggling)  # the same records on CPU
    for records in (waiting, straggling):
        assert not {f.code for f in analyze(cuda, records).findings} & {"input-bound", "straggler-rank"}


def gpu_timed(rank: int, rows: list[tuple[float, ...]], gpu: list[tuple[float, float]], loaders=()) -> RankRecord:
    """`timed`, with the GPU's clock (the GPU's idle time before the forward, the step on the GPU; ms) in the last
    two columns, as a DDP on CUDA records them (the first step's NaN: no step end before it)."""
    r = timed(rank, rows, loaders)
    device = torch.tensor(gpu, dtype=torch.float64) * MS
    device[0] = float("nan")
    r.timing = torch.cat([r.timing, torch.zeros(len(rows), 1, dtype=torch.float64), device], 1)
    return r


def test_on_gpus_input_bound_decides_on_the_gpus_idle_time_not_the_hosts_wait() -> None:
    """The host's 20 ms between steps is its wait in `loss.item()` for a busy GPU, idle 0.2 ms of a 30 ms step: not
    input-bound. A GPU idle 20 ms of a 25 ms step is, in the GPU's words; the host's phases do not decide."""
    cuda = info(ddp_config={"find_unused_parameters": False, "static_graph": False, "device_ids": [0]})
    busy = [gpu_timed(r, steady(data=20.0), [(0.2, 30.0)] * STEPS, loaders=[LOADER]) for r in range(2)]
    assert not {f.code for f in analyze(cuda, busy).findings} & {"input-bound", "straggler-rank"}
    idle = [gpu_timed(r, steady(data=0.1), [(20.0, 25.0)] * STEPS, loaders=[LOADER]) for r in range(2)]
    d = analyze(cuda, idle)
    f = next(f for f in d.findings if f.code == "input-bound")
    assert f.ranks == [0, 1]
    measured = {m.name: m.value for m in f.measured}  # 20.0 ms of 25.0 ms
    assert measured["data_wait"] == pytest.approx(0.020) and measured["step"] == pytest.approx(0.025)
    assert "the GPU's clock" in f.detail  # which clock measured it: not in the evidence
    report = Report.build(RunFacts.of_model(cuda, world_size=2, backend="nccl"), d)
    data = json.loads(report.to_json())
    one = data["timing"]["per_rank"][1]
    assert one["clock"] == "gpu" and one["steps"] == STEPS - 1
    assert one["data_wait_s"] == pytest.approx(0.020) and one["step_s"] == pytest.approx(0.025)
    assert Report.from_dict(data).to_dict()["timing"] == data["timing"]
    text = to_text(report, width=300)
    assert "on the GPU's clock, ms (GPU idle waiting for data/step): rank 0 20.0/25.0; rank 1 20.0/25.0" in text
    assert "class='step-time'" not in report.to_html()  # no phases figure: the GPU's phases are not timed
    # One rank much slower on the GPU, with the host's phases of a straggler: no straggler-rank there (NCCL's
    # waits are not timed), with `device_ids` or without them (a single-device CUDA module wrapped without).
    slow = [
        gpu_timed(0, steady(comm=25.0), [(0.2, 30.0)] * STEPS),
        gpu_timed(1, steady(fwd=26.0), [(0.2, 60.0)] * STEPS),
    ]
    assert "straggler-rank" in codes([timed(0, steady(comm=25.0)), timed(1, steady(fwd=26.0))])  # on CPU
    assert "straggler-rank" not in {f.code for f in analyze(cuda, slow).findings}
    assert "straggler-rank" not in codes(slow)


def test_a_rank_whose_gpu_timed_some_steps_only_is_judged_on_those() -> None:
    """The events of the last steps not reached when the report read them: those steps are left out."""
    cuda = info(ddp_config={"find_unused_parameters": False, "static_graph": False, "device_ids": [0]})
    gpu = [(20.0, 25.0)] * (STEPS - 1) + [(float("nan"), float("nan"))]
    d = analyze(cuda, [gpu_timed(r, steady(data=0.1), gpu, loaders=[LOADER]) for r in range(2)])
    assert d.timing.per_rank[0].steps == STEPS - 2 and d.timing.per_rank[0].gpu_clock
    assert "input-bound" in {f.code for f in d.findings}


def test_input_bound_needs_a_dataloader() -> None:
    """Without one the time between steps is the loop's own (observe_overhead times two other models there)."""
    assert "input-bound" not in codes([timed(r, steady(data=20.0)) for r in range(2)])


# ------------------------------------------------------------------------------------------------ straggler-rank


def test_a_slow_rank_the_others_wait_for_is_named_with_its_phase_and_the_time_lost() -> None:
    fast = steady(comm=25.0)
    slow = steady(fwd=26.0, comm=0.5)
    d = analyze(info(), [timed(0, fast), timed(1, slow), timed(2, fast)])
    f = next(f for f in d.findings if f.code == "straggler-rank")
    assert f.ranks == [1]
    measured = {m.name: (m.value, m.unit) for m in f.measured}
    # Its own work (29.0 ms against the others' 4.0 ms: 7.2x slower), to the report's 0.1 ms; the others lose 25.0
    # ms per step waiting for it.
    assert measured["own_work_slowest"] == (pytest.approx(0.029, abs=5e-5), "s")
    assert measured["own_work_others"] == (pytest.approx(0.004, abs=5e-5), "s")
    assert measured["others_wait"] == (pytest.approx(0.025, abs=5e-5), "s")
    assert measured["steps_timed"] == (STEPS - 1, "count")
    assert f.labels == {"clock": "host", "phase": "forward"}  # the phase its extra time goes to


def test_a_rank_slow_only_while_waiting_for_a_cpu_is_no_straggler() -> None:
    """The steps of rank 1 take 25 ms longer, all of it spent ready to run but waiting for a CPU (Linux's run-queue
    delay, the timing row's sixth column): another job on the machine, not the rank's work. The fresh-clone run
    with other tests loading the 2 cores reported straggler-rank on 8 clean scenarios before the wait was taken
    out; the same 25 ms spent computing is a straggler."""
    fast = [(*row, 0.0) for row in steady(comm=25.0)]
    starved = [(*row, 25.0) for row in steady(fwd=26.0, comm=0.5)]
    working = [(*row, 0.0) for row in steady(fwd=26.0, comm=0.5)]
    assert "straggler-rank" not in codes([timed(0, fast), timed(1, starved), timed(2, fast)])
    assert "straggler-rank" in codes([timed(0, fast), timed(1, working), timed(2, fast)])


@pytest.mark.parametrize(
    "fast, slow",
    [
        # Slower, but by a few milliseconds only.
        pytest.param(steady(comm=3.0), steady(fwd=4.0), id="too-few-ms"),
        # Slower by 25 ms in 2 steps of 8: noise on a busy machine, not a straggler.
        pytest.param(
            steady(comm=1.0), [(26.0 if s in (2, 5) else 1.0, 2.5, 0.5, 0.5, 0.5) for s in range(STEPS)], id="rarely"
        ),
        # Slower in most steps, but by amounts that scatter more than the difference (13 to 93 ms against about
        # 40 ms): a rank starved of CPU by another job on a shared machine, not one that does more work.
        pytest.param(
            steady(comm=25.0),
            [(f, 2.5, 0.5, 0.5, 0.5) for f in (12.0, 70.0, 10.0, 40.0, 90.0, 12.0, 80.0, 14.0)],
            id="scattered",
        ),
        # The others do not wait for it (they are not in lockstep with it): not this finding.
        pytest.param(steady(comm=0.5), steady(fwd=26.0), id="nobody-waits"),
        # Every rank waits 25 ms in the all-reduce, the slow one too: that wait is not for it (it reaches the
        # all-reduce last, so a wait for it is one it does not share).
        pytest.param(steady(comm=25.0), steady(fwd=26.0, comm=25.0), id="everyone-waits"),
    ],
)
def test_straggler_needs_a_large_consistent_gap_that_the_others_pay_for(fast, slow) -> None:
    assert "straggler-rank" not in codes([timed(0, fast), timed(1, slow)])


def test_the_clean_records_show_neither_and_one_rank_has_nothing_to_compare() -> None:
    assert not codes([timed(r, steady()) for r in range(4)]) & {"input-bound", "straggler-rank"}
    assert "straggler-rank" not in codes([timed(0, steady(fwd=40.0))])


# ------------------------------------------------------------------------------------------------ the report


def test_per_rank_phases_in_the_json_keep_the_old_timing_keys_and_survive_a_round_trip() -> None:
    records = [timed(0, steady(comm=25.0)), timed(1, steady(fwd=26.0))]
    d = analyze(info(), records)
    report = Report.build(RunFacts.of_model(info(), world_size=len(records), backend="gloo"), d)
    data = json.loads(report.to_json())
    timing = data["timing"]
    assert {"forward_s", "backward_s", "optimizer_s", "step_s"} <= set(timing)
    assert [r["rank"] for r in timing["per_rank"]] == [0, 1]
    one = timing["per_rank"][1]
    for key in ("data_wait_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s", "step_s"):
        assert isinstance(one[key], float), key
    assert one["forward_s"] == pytest.approx(0.026) and one["steps"] == STEPS - 1
    assert one["backward_s"] == pytest.approx(0.002)  # backward compute: the all-reduce wait is its own phase
    assert Report.from_dict(data).to_dict()["timing"] == timing
    assert "rank 1 0.5/26.0/2.0/0.5/0.5" in to_text(report, width=300)
    html = report.to_html()
    assert "class='step-time'" in html and "rank 1</text>" in html


def test_beyond_four_ranks_the_text_line_names_the_slowest_and_the_fastest_rank() -> None:
    records = [timed(r, steady(comm=25.0)) for r in range(6)]
    records[4] = timed(4, steady(fwd=26.0))
    d = analyze(info(), records)
    assert next(f for f in d.findings if f.code == "straggler-rank").ranks == [4]
    text = to_text(Report.build(RunFacts.of_model(info(), world_size=len(records), backend="gloo"), d), width=300)
    line = next(x for x in text.splitlines() if x.startswith("step per rank"))
    assert "rank 4 (slowest) 0.5/26.0/2.0/0.5/0.5" in line and "(fastest)" in line and line.count("rank ") == 2


# ------------------------------------------------------------------------------------------------ the exchange


def _job(world: int) -> list[RankRecord]:
    """`world` ranks with varied phases: ranks 5, 66, 68 and 69 wait for data, rank 67 is slow."""
    records = []
    for r in range(world):
        rows = steady(fwd=1.0 + (r % 7) * 0.25, comm=0.5 + (r % 5) * 0.1, data=0.5 + (r % 3) * 0.2)
        if r == 5 or r >= 66:
            rows = steady(data=30.0 + r % 4)
        if r == 67:
            rows = steady(fwd=40.0, data=30.0)
        records.append(timed(r, rows))
    return records


@pytest.mark.parametrize("world", [2, 3, 9, 70])
def test_the_exchange_gives_what_every_ranks_timing_gives_in_a_bounded_volume(world: int) -> None:
    from ddp_doctor.core.steptime import step_times
    from ddp_doctor.exchange import summarize
    from ddp_doctor.exchange.ranktable import local_timing

    records = _job(world)
    summary = summarize(info(), records)
    s = summary.steps
    expected = step_times([local_timing(r, s, r.rank) for r in records])
    got = summary.step_times
    assert [t.to_row() for t in got.shown] == [t.to_row() for t in expected.shown]
    assert [t.rank for t in got.shown] == [t.rank for t in expected.shown]
    for name in ("measured", "slowest", "fastest", "steps", "waiting", "waiting_ranks", "waiting_steps"):
        assert getattr(got, name) == getattr(expected, name), name
    for name in ("waiting_median", "others_median"):
        a, b = getattr(got, name), getattr(expected, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a == pytest.approx(b, rel=1e-12, abs=0.0), name
    assert got.others_q3_max == pytest.approx(expected.others_q3_max)
    if world == 70:
        shown = {t.rank for t in got.shown}
        # Rank 67 waits 30 ms too, but its 40 ms forward keeps the wait under half of its step.
        assert got.slowest == 67 and shown == {*range(8), 67, got.fastest} and got.waiting == 4
        # Named by slot (rank modulo 64, the lowest of each): 69 shares rank 5's slot and is counted, not named.
        assert got.waiting_ranks == [5, 66, 68]


def test_the_step_phases_cost_no_row_per_rank() -> None:
    from ddp_doctor.exchange import summarize

    small, large = (summarize(info(), _job(w)).volume for w in (9, 200))
    # Only packed counts grow, by log2 of the world size; a row per rank would add 191 * ROW_SIZE * 8 = 26 KB.
    assert large.collectives == small.collectives and large.sent - small.sent < 5_000, (small.sent, large.sent)
