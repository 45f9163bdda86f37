"""`ddp-doctor watch` past the first steps, window by window: a job that becomes input-bound, a rank whose reads
become slow (a straggler), on one node and judged over two nodes' ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkrun import SCRIPTS
from watchrun import explain, two_nodes, watch


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
