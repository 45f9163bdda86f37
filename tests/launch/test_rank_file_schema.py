"""The rank <-> supervisor files: what the rank side writes, the supervisor reads back, typed and versioned."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ddp_doctor.core.beacon import BEACON_SCHEMA, Beacon, ClosedStep, Collective, read_beacon
from ddp_doctor.core.rankfiles import (
    END_SCHEMA,
    PROGRESS_SCHEMA,
    EndRecord,
    ExplainedError,
    Outcome,
    ProgressSample,
    RaisedError,
    end_path,
    read_end,
    write_end,
    write_progress,
)
from ddp_doctor.core.rankstate import read_rank_states
from ddp_doctor.launch.watchdog import peers_wait_in_collective


def test_what_a_crashed_rank_writes_is_what_the_supervisor_reads(tmp_path: Path) -> None:
    beacon = Beacon(tmp_path / "rank1.beacon")
    buffers = Collective(op="broadcast", n=1, tensor="2 buffers of the DDP model built at train.py:9", ddp_buffers=True)
    last = Collective(op="all_reduce", n=2, tensor="float32[4]", site="train.py:41")
    beacon.update(
        step=3,
        phase="backward",
        site="train.py:40",
        collective=last,
        recent=[buffers, last],
        in_collective=True,
        collectives=2,
        closed=ClosedStep(step=2, missing=["head.weight"]),
    )
    raised = RaisedError(
        type="RuntimeError",
        message="Expected to have finished reduction",
        step=3,
        phase="forward",
        explained=ExplainedError(code="reduction-error", params=["head.weight"], message="...", numels=[12]),
    )
    write_end(tmp_path, EndRecord(rank=1, world_size=2, outcome=Outcome.CRASHED, raised=raised, ddp_models=1))
    write_progress(tmp_path, ProgressSample(rank=1, world_size=2, step=3, phase="backward", user_frame="train.py:40"))

    assert json.loads(end_path(tmp_path, 1).read_text())["schema"] == END_SCHEMA
    assert json.loads((tmp_path / "rank1.progress.json").read_text())["schema"] == PROGRESS_SCHEMA
    assert read_beacon(tmp_path / "rank1.beacon").schema == BEACON_SCHEMA
    (state,) = read_rank_states(tmp_path, end_time=beacon.state.time + 5.0).values()
    assert state.rank == 1 and state.world_size == 2 and state.outcome is Outcome.CRASHED and state.built_ddp
    assert state.raised == raised
    assert state.step == 3 and state.phase == "backward" and state.site == "train.py:40"
    assert (
        state.in_collective and state.collective is not None and state.collective.describe() == "all_reduce(float32[4])"
    )
    assert state.closed == ClosedStep(step=2, missing=["head.weight"])
    assert state.user_frame == "train.py:40" and 4.0 < state.position_age_s < 6.0
    assert state.recent == [buffers, last]  # the ring, DDP's buffer broadcast marked as such


def test_a_step_published_alone_is_read_over_the_states_and_never_overwritten_by_it(tmp_path: Path) -> None:
    """`watch` publishes each step past the first ones in the beacon's step slot, not its JSON; a reader takes the
    later of the two, with that step's time. The longest JSON stops short of the slot."""
    path = tmp_path / "rank0.beacon"
    beacon = Beacon(path)
    assert read_beacon(path).step == -1  # the slot was never written
    beacon.update(step=8, phase="watched")
    at = read_beacon(path).time
    time.sleep(0.01)
    beacon.step(40)
    state = read_beacon(path)
    assert state.step == 40 and state.phase == "watched" and state.time > at
    beacon.update(forwards={f"train.py:{i}": i for i in range(5000)})  # longer than the beacon: cut, so not read
    assert read_beacon(path) is None
    beacon.update(forwards={})
    assert read_beacon(path).step == 40


def test_the_first_ending_wins_unless_overwritten(tmp_path: Path) -> None:
    assert write_end(tmp_path, EndRecord(rank=0, outcome=Outcome.REPORTED, reason="8 steps observed"))
    assert not write_end(tmp_path, EndRecord(rank=0, outcome=Outcome.EXITED, status=3))
    assert read_end(end_path(tmp_path, 0)).outcome is Outcome.REPORTED
    late = RaisedError(type="ValueError", message="loss is NaN")
    assert write_end(tmp_path, EndRecord(rank=0, outcome=Outcome.CRASHED_AFTER_REPORT, raised=late), overwrite=True)
    assert read_end(end_path(tmp_path, 0)).raised == late


def test_a_file_of_another_schema_is_not_read(tmp_path: Path) -> None:
    end_path(tmp_path, 0).write_text(json.dumps({"rank": 0, "outcome": "crashed", "crash": {"type": "X"}}))
    assert read_end(end_path(tmp_path, 0)) is None
    (tmp_path / "rank0.progress.json").write_text(json.dumps({"schema": "ddp-doctor/rank-progress@0", "rank": 0}))
    assert read_rank_states(tmp_path, end_time=0.0) == {}


def test_a_crashed_peer_is_not_taken_for_one_waiting_in_ddps_all_reduce(tmp_path: Path) -> None:
    """A rank whose crash closed its step in backward looks, by step and phase alone, like a rank whose backward
    computed every gradient and waits in DDP's all-reduce; its beacon says it crashed, so a peer that crashed too
    waits for it at the exchange (a2719d7 made both leave at once: one box per rank)."""
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)  # past its start: its main thread sleeps in the kernel, as one waiting in all-reduce does
        peer = Beacon(tmp_path / "rank1.beacon")
        peer.update(step=0, phase="backward", closed=ClosedStep(step=0, missing=["head.weight"]), pid=sleeping.pid)
        assert not peers_wait_in_collective(tmp_path, 0, watch_s=0.0)  # just got there: it may be passing through
        assert peers_wait_in_collective(tmp_path, 0, watch_s=2.0)  # still there after a while, blocked: it waits
        peer.update(phase="optimizer step", closed=None, in_collective=True)
        assert peers_wait_in_collective(tmp_path, 0, watch_s=2.0)  # blocked in a collective of the script's
        peer.update(crashed=True)
        assert not peers_wait_in_collective(tmp_path, 0, watch_s=1.0)
    finally:
        sleeping.kill()
        sleeping.wait()


def test_a_peer_that_still_runs_is_not_taken_for_one_waiting_in_ddps_all_reduce(tmp_path: Path) -> None:
    """A peer between two backward passes through one forward (Lightning's GAN: the first pass closed the step in
    backward, the second is about to fail as this rank's did) shows the same beacon as one waiting in all-reduce,
    for over a second on a busy machine; its main thread runs, though, where a waiting one sleeps in the kernel."""
    running = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        peer = Beacon(tmp_path / "rank1.beacon")
        peer.update(step=0, phase="backward", closed=ClosedStep(step=0, missing=["head.weight"]), pid=running.pid)
        assert not peers_wait_in_collective(tmp_path, 0, watch_s=2.0)
        # Just out of a collective both ranks entered (Lightning's clean-up after the error), its beacon not yet
        # updated: it runs on to the exchange. Taken for a waiting one, the GAN's report lost its joint finding in
        # 3 of 15 runs beside 4 to 6 busy processes on 2 cores (none of 10 after).
        peer.update(phase="optimizer step", in_collective=True)
        assert not peers_wait_in_collective(tmp_path, 0, watch_s=2.0)
    finally:
        running.kill()
        running.wait()


def test_an_fsdp2_ranks_fullest_beacon_is_read_back_whole(tmp_path: Path) -> None:
    """Its three counted maps at their 8 lines each, with a cluster's long paths: about 4.2 KiB of JSON, more than
    the 4 KiB the beacon had, where the cut JSON read as no beacon at all and the failure report lost the rank."""
    where = (
        "/lustre/fsx/users/first.last/experiments/2026-11/llama-style-finetune-with-fsdp2-run-042/"
        "src/training/train_with_fsdp2_and_evaluation.py"
    )
    beacon = Beacon(tmp_path / "rank0.beacon")
    beacon.update(
        step=3,
        sharding={"api": "fully_shard", "sharded_modules": 33, "mesh": [[4, 8]], "mesh_dims": ["replicate", "shard"]},
        forwards={f"{where}:{i}": i for i in range(8)},
        state_dicts={f"{where}:{100 + i}": 1 for i in range(8)},
        gathers={f"get_model_state_dict at {where}:{200 + i}": 1 for i in range(8)},
        train_loader={"site": f"{where}:50", "batches": 1200},
    )
    read = read_beacon(tmp_path / "rank0.beacon")
    assert read is not None and read.step == 3 and len(read.gathers) == len(read.state_dicts) == 8
    assert read.train_loader == {"site": f"{where}:50", "batches": 1200}
