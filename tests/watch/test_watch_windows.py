"""`ddp-doctor watch` past the first steps, window by window: a job that becomes input-bound, a rank whose reads
become slow or whose own work does (a straggler), on one node and judged over two nodes' ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkrun import SCRIPTS
from watchrun import checksums, explain, two_nodes, watch

from ddp_doctor.launch.watch_windows import CLEAR_AFTER, WindowWatch, replay


def test_a_job_that_becomes_input_bound_past_its_first_steps_is_named_from_its_first_slow_window(
    tmp_path: Path,
) -> None:
    """200 steps whose batches come from a DataLoader without workers; from step 100 on each item takes 40 ms to
    read (SLOW_FROM=100, SLOW_S=0.04), on both ranks. Under plain torchrun the job ends with status 0 and nothing
    said (both ranks' weights end with checksum -2.635275349603, as under watch). Under watch, past the 8 observed
    steps each rank writes a window of 32 steps at a time: the windows before
    step 100 are not input-bound, the first window that lies wholly past it is, for both ranks, and the job goes on
    to its end (exit 0: a window's finding is said, not failed on)."""
    env = {"STEPS": "200", "SLOW_FROM": "100", "SLOW_S": "0.04"}
    run = watch(["--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")], tmp_path, env=env)
    assert run.rc == 0, run.output
    windows = run.ended["windows"]
    assert windows["schema"] == "ddp-doctor/windows@1" and windows["window"] == 32, windows
    judged = windows["windows"]
    assert all(w["ranks"] == [0, 1] for w in judged) and len(judged) >= 4, judged
    before = [w for w in judged if w["last"] < 100]
    after = [w for w in judged if w["first"] > 101]  # step 101 is the first whose batch (item 100) was slow
    assert before and not any(w["input_bound"] for w in before), judged
    assert after and all(w["input_bound"] and w["waiting"] == [0, 1] for w in after), judged
    assert all(w["wait_s"][0] >= 0.03 for w in after), after  # the 40 ms read, measured on each rank
    # `explain` says the same change again from the run folder: the same window, in the same words.
    said = next(line for line in run.output.splitlines() if "input-bound from steps" in line)
    rc, explained, _ = explain(run.run_dir, tmp_path)
    assert rc == 0 and said in explained, explained


def test_a_rank_whose_reads_become_slow_past_its_first_steps_is_named_a_straggler_from_its_first_slow_window(
    tmp_path: Path,
) -> None:
    """As above, but only rank 1's items take 40 ms to read from step 100 on (SLOW_RANK=1). Under plain torchrun the
    job ends with status 0 and nothing said, in 9.3 s against 5.4 s with no slow read: rank 0 waits for rank 1 in
    DDP's all-reduce at every step. Under watch the windows before step 100 are clean; each window wholly past it
    names rank 1 a straggler (it waits for its data, rank 0 does not), not the job input-bound; the job runs to its
    end (exit 0)."""
    env = {"STEPS": "200", "SLOW_FROM": "100", "SLOW_S": "0.04", "SLOW_RANK": "1"}
    run = watch(["--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")], tmp_path, env=env)
    assert run.rc == 0, run.output
    judged = run.ended["windows"]["windows"]
    before = [w for w in judged if w["last"] < 100]
    after = [w for w in judged if w["first"] > 101]
    assert before and not any(w["lagging"] or w["input_bound"] for w in before), judged
    # (a window where a busy machine scattered rank 1's steps by more than its wait is not judged waiting: the first
    # steps' rule; seen once in five windows under pytest-xdist)
    lagging = [w for w in after if w["lagging"]]
    assert 2 * len(lagging) > len(after) and all(w["lagging"] == [1] for w in lagging), judged
    assert not any(w["input_bound"] for w in after), judged
    assert all(w["waiting_wait_s"][0] >= 0.03 and w["others_wait_s"] < 0.02 for w in lagging), lagging
    said = next(line for line in run.output.splitlines() if "straggler-rank (rank 1)" in line)
    rc, explained, _ = explain(run.run_dir, tmp_path)
    assert rc == 0 and said in explained, explained


def test_a_rank_whose_own_work_becomes_slow_past_its_first_steps_is_named_a_straggler(tmp_path: Path) -> None:
    """From step 100 on rank 1 spins 40 ms between its forward and its backward (WORK_RANKS=1: a slower device, or
    work of its own in the loss). Under plain torchrun (STEPS=200) the job ends with status 0 and nothing said, in
    12.8 s against 8.7 s without the spin (both ranks' checksums -2.279683708330 either way on one Intel Xeon,
    -2.279683619738 on another: float32's last digits differ by CPU): rank 0 waits for rank 1 in DDP's all-reduce
    at every step. No rank waits for data, so the data rule names nobody; under watch each
    window wholly past step 100 (most of them, on a busy machine) names rank 1 a straggler in its own work before
    the backward, about 40 ms longer than rank 0's, which spends about that much longer in the rest of its step. The
    job computes what it computes under torchrun, and `explain` says the same afterwards."""
    env = {"STEPS": "200", "WORK_RANKS": "1", "WORK_FROM": "100", "WORK_S": "0.04"}
    run = watch(["--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")], tmp_path, env=env)
    assert run.rc == 0, run.output
    sums = checksums(run.output)
    assert len(set(sums.values())) == 1 and len(sums) == 2, run.output  # the replicas agree
    assert abs(float(sums[0]) - -2.2796837) < 1e-6, sums  # what plain torchrun computes, to float32's rounding
    judged = run.ended["windows"]["windows"]
    before = [w for w in judged if w["last"] < 100]
    after = [w for w in judged if w["first"] > 100]
    assert before and not any(w["lagging"] for w in before), judged
    lagging = [w for w in after if w["lagging"]]
    assert 2 * len(lagging) > len(after) and all(w["lagging"] == [1] for w in lagging), judged
    assert all(w["lagging_in"] == "work" and not w["input_bound"] for w in lagging), lagging
    # rank 1's own work before the backward is the 40 ms spin longer; rank 0 waits most of that in DDP's all-reduce
    assert all(w["own_s"][0] - w["others_own_s"] >= 0.03 and w["others_waited_s"] >= 0.02 for w in lagging), lagging
    said = next(line for line in run.output.splitlines() if "straggler-rank (rank 1)" in line)
    rc, explained, _ = explain(run.run_dir, tmp_path)
    assert rc == 0 and said in explained, explained


def test_every_rank_slower_in_its_own_work_is_no_straggler(tmp_path: Path) -> None:
    """The neighbour: both ranks spin 40 ms from step 100 on (WORK_RANKS=0,1; under plain torchrun status 0, 16.6 s,
    the same checksums). Nobody waits for anybody: no window names a straggler; the step grew, and that is said."""
    env = {"STEPS": "200", "WORK_RANKS": "0,1", "WORK_FROM": "100", "WORK_S": "0.04"}
    run = watch(["--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")], tmp_path, env=env)
    assert run.rc == 0, run.output
    judged = run.ended["windows"]["windows"]
    assert len(judged) >= 4 and not any(w["lagging"] for w in judged), judged
    assert "straggler-rank" not in run.output
    assert any(w["step_s"][0] >= 0.03 for w in judged if w["first"] > 100), judged


def _rows(folder: Path, rank: int, own_s: float, rest_s: float) -> None:
    """Rank `rank`'s one window of 32 steps, as a rank writes it: `own_s` before the backward (no wait for data),
    `rest_s` after, a tight spread."""
    row = {"first": 10, "last": 41, "steps": 32, "step_s": own_s + rest_s, "wait_s": 0.0005, "share_q1": 0.01}
    row |= {"step_iqr_s": 0.001, "loader": None, "own_s": own_s, "own_q1_s": own_s - 0.001}
    row |= {"own_q3_s": own_s + 0.001, "rest_s": rest_s}
    (folder / "windows").mkdir(exist_ok=True)
    (folder / "windows" / f"rank{rank}.json").write_text(json.dumps({"windows": [row]}))


@pytest.mark.parametrize(
    ("slow", "waited", "named"),
    [
        ({5: 0.050}, 0.045, [5]),  # one of 8 ranks: the others wait 45 ms longer in their all-reduce
        ({2: 0.050, 6: 0.060}, 0.045, [2, 6]),  # two of them
        ({5: 0.050}, 0.010, []),  # a rank slower before the backward that nobody waits for: not a straggler
        ({5: 0.014}, 0.010, []),  # 4 ms longer: under MIN_WAIT_S
        ({r: 0.050 for r in range(5)}, 0.045, []),  # more than half: the job's step, nobody's straggler
    ],
)
def test_the_window_rule_names_the_ranks_whose_own_work_lags_and_only_when_the_others_wait(
    tmp_path: Path, slow: dict[int, float], waited: float, named: list[int]
) -> None:
    """The parent's rule on windows written by hand for 8 ranks: 10 ms of own work before the backward on the
    others, 5 ms after it on the slow ranks and `waited` more on the others."""
    for r in range(8):
        _rows(tmp_path, r, slow.get(r, 0.010), 0.005 + (0.0 if r in slow else waited))
    events = WindowWatch(folder=tmp_path).poll(set(range(8)))
    stragglers = [e for e in events if e.kind == "straggler-rank"]
    assert [e.ranks for e in stragglers] == ([named] if named else []), events
    if named:
        e = stragglers[0]
        assert e.lag == "work" and e.others_own_s == pytest.approx(0.010), e
        assert e.own_s == pytest.approx((min(slow.values()), max(slow.values())))


def _judged(first: int, lagging: list[int], bound: bool) -> dict:
    """A judged window as windows.json keeps it: 2 ranks, rank `lagging` waiting for its data, or both (`bound`)."""
    waiting = [0, 1] if bound else lagging
    return {
        "first": first,
        "last": first + 31,
        "ranks": [0, 1],
        "step_s": [0.05, 0.05],
        "wait_s": [0.001, 0.04],
        "waiting": waiting,
        "waiting_wait_s": [0.04, 0.04] if waiting else None,
        "loader": None,
        "input_bound": bound,
        "others_wait_s": 0.001,
        "lagging": lagging,
        "lagging_in": "data" if lagging else None,
    }


@pytest.mark.parametrize("bound", [False, True])
def test_one_quiet_window_neither_ends_a_condition_nor_starts_it_again(bound: bool) -> None:
    """A straggler (or an input-bound job) whose condition a busy machine hid in one window: said once, not ended
    and started again; its end is said after `CLEAR_AFTER` quiet windows in a row."""
    on = ([] if bound else [1], bound)
    off = ([], False)
    kinds = ("input-bound", "input-ok") if bound else ("straggler-rank", "straggler-ok")
    seen = [on, off, on, on, *[off] * CLEAR_AFTER]
    events = replay({"windows": [_judged(10 + 32 * i, *w) for i, w in enumerate(seen)]})
    said = [(e.kind, e.first) for e in events if e.kind in kinds]
    assert said == [(kinds[0], 10), (kinds[1], 10 + 32 * (len(seen) - 1))], said


@pytest.mark.serial  # the windows' verdict rests on each rank's wall-clock waits; two agents at once
def test_two_nodes_judge_each_window_over_both_nodes_ranks(tmp_path: Path) -> None:
    """Two torchrun agents on this machine, one rank each, each under its own `watch` and run folder; rank 1's reads
    take 40 ms from step 100 on (SLOW_RANK=1; under plain torchrun on one node the job ends with status 0, nothing
    said, rank 0 waiting for rank 1 in DDP's all-reduce). Judged on its own, the node of rank 1 would call its one
    rank input-bound; through the rendezvous store each node judges the windows past step 100 over both ranks:
    rank 1 waits for its data alone, a straggler, and the job is not input-bound."""
    env = {"STEPS": "300", "SLOW_FROM": "100", "SLOW_S": "0.04", "SLOW_RANK": "1"}
    codes, outputs = two_nodes(tmp_path, env, [], timeout=240)
    assert codes == [0, 0], outputs
    for n in (0, 1):
        judged = json.loads((tmp_path / f"node{n}" / "windows.json").read_text())["windows"]
        after = [w for w in judged if w["first"] > 101]
        assert judged and all(w["ranks"] == [0, 1] for w in judged), (n, judged)
        lagging = [w for w in after if w["lagging"]]  # a busy machine may leave a window unjudged, as above
        assert 2 * len(lagging) > len(after) and all(w["lagging"] == [1] for w in lagging), (n, judged)
        assert not any(w["input_bound"] for w in after), (n, judged)
