"""`ddp-doctor watch`: the whole job runs as it would under torchrun, computing what it computes; a signal to
`watch` ends every process of the job; bad arguments and a folder without records are named with the fix. Its
first steps' diagnosis, its windows of steps, its replica comparison and its hangs have files of their own beside
this one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from checkrun import EXAMPLES, REPO, SCRIPTS, assert_no_leftovers
from frameworkrun import ran_to_end
from watchrun import checksums, explain, watch


def test_a_clean_job_runs_to_its_end_computing_what_it_computes_under_torchrun(tmp_path: Path) -> None:
    """30 steps where the check observes 8: every rank trains all 30, its weights end bit for bit as under plain
    torchrun, its non-daemon thread is joined and its atexit handler runs, as at any interpreter's end. A
    --hang-after longer than the group's timeout is warned about with both values."""
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran_to_end(plain), plain.stderr[-3000:]  # torch 2.13's abort at exit aside
    run = watch(
        ["--nproc-per-node", "2", "--hang-after", "90", str(SCRIPTS / "watch_job.py")], tmp_path, env={"STEP_S": "0.15"}
    )
    assert run.rc == 0, run.output
    assert run.report is not None and run.report["findings"] == [], run.output
    assert checksums(run.output) == checksums(plain.stdout) and len(checksums(plain.stdout)) == 2, run.output
    for rank in (0, 1):
        assert f"rank {rank} thread joined" in run.output and f"rank {rank} atexit ran" in run.output, run.output
    ended = run.ended
    assert ended["failed"] is False and ended["steps"] == 30, ended
    assert ended["replicas"] == {
        "schema": "ddp-doctor/replicas@1",
        "compared_steps": [16],  # past the 8 observed steps, every 16th (steps of 0.15 s: the fewest allowed)
        "ranks": [0, 1],
        "divergence": None,
    }, ended
    assert ended["windows"]["windows"] == [], ended  # 22 watched steps: no window of 32 closed
    assert run.hang is None
    assert "--hang-after 90 s" in run.output and "(60 s)" in run.output, run.output
    # The first steps' report came while the job went on (22 steps of 0.15 s at least): before its last lines.
    assert run.output.index("the first steps are diagnosed") < run.output.index("rank 0 trained 30 steps")


def test_sigterm_to_watch_while_the_job_trains_on_ends_every_process(tmp_path: Path) -> None:
    """SIGTERM to `watch` after the first steps' report, while the job trains on: exit code 143, the partial report
    and the run folder's end record, and no process of the job left (a /proc scan)."""
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddp_doctor.cli", "watch", "--run-dir", str(run_dir), "--nproc-per-node", "2"]
        + [str(SCRIPTS / "watch_job.py")],
        cwd=REPO,
        env={**os.environ, "STEP_S": "0.5", "DDP_DOCTOR_TEST_TAG": tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "the first steps are diagnosed" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=60)
    output = "".join(lines) + rest
    assert proc.returncode == 143, output
    assert "interrupted by SIGTERM" in output and "trained 30 steps" not in output, output
    assert json.loads((run_dir / "watch.json").read_text())["failed"] is True
    assert_no_leftovers(tag)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--hang-after", "0"], "--hang-after must be a positive number of seconds, got 0"),
        (["--run-dir", "/proc/version/run"], "the run folder '/proc/version/run' cannot be written"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be a positive number of processes"),
    ],
)
def test_bad_watch_arguments_are_named_with_the_fix(args: list[str], needle: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "watch", "--nproc-per-node", "2", *args, str(EXAMPLES / "clean.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and needle in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_explain_names_a_folder_without_records(tmp_path: Path) -> None:
    rc, output, _ = explain(tmp_path, tmp_path)
    assert rc == 2 and "holds no ddp-doctor records" in output and "Traceback" not in output, output
    rc, output, _ = explain(tmp_path / "nowhere", tmp_path)
    assert rc == 2 and "is not a folder" in output, output
