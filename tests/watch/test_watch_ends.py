"""`ddp-doctor watch` at a job's end: a job shorter than the observed steps is diagnosed and still runs every line
past its `destroy_process_group()`, and a rank that fails after the process group is gone failed in the teardown:
no other rank is said to have left early."""

from __future__ import annotations

from pathlib import Path

from checkrun import SCRIPTS
from watchrun import checksums, explain, plain, watch


def test_a_job_shorter_than_the_observed_steps_is_diagnosed_and_runs_past_its_process_group(tmp_path: Path) -> None:
    """Ground truth (plain torchrun, STEPS=5): exit 0; each rank prints its checksum, then a line after its
    `destroy_process_group()`, then its thread's and its atexit handler's lines.

    Under `watch` (8 observed steps by default) the same: every line past the process group runs (the report is made
    while the group exists, and the script goes on), the checksums are torchrun's, and the 5 steps' report is
    printed and written, with nothing said to be unchecked after them (there was no later step)."""
    torchrun = plain("watch_job.py", {"STEPS": "5"})
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    run = watch(["--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")], tmp_path, env={"STEPS": "5"})
    assert run.rc == 0, run.output
    assert checksums(run.output) == checksums(torchrun.stdout) and len(checksums(torchrun.stdout)) == 2, run.output
    for rank in (0, 1):
        for what in ("ran past its process group", "thread joined", "atexit ran"):
            assert f"rank {rank} {what}" in run.output, run.output
    assert run.report is not None and run.report["findings"] == [] and run.report["steps_observed"] == 5
    assert run.report.get("unchecked", []) == [], run.report["unchecked"]
    assert "steps observed  5" in run.output, run.output  # the report was printed, not only written
    ended = run.ended
    assert ended["failed"] is False and ended["steps"] == 5, ended


def test_a_rank_that_aborts_after_destroying_its_process_group_failed_in_the_teardown(tmp_path: Path) -> None:
    """Ground truth (plain torchrun, STEPS=5, rank 1 aborts 0.5 s after `destroy_process_group()`): exit 1, torchrun
    names rank 1's SIGABRT (exitcode -6) as the root cause; both ranks trained their 5 steps and printed the line
    after the process group, rank 0 its atexit line.

    Under `watch`: exit 1 and one `rank-crashed` for rank 1, whose phase is the teardown; rank 0, which ended
    normally after its own teardown, is not `rank-exited` (no collective was left for anyone to wait in). The same
    past the observed steps (STEPS=12), and `explain` on the run folder says the same afterwards."""
    torchrun = plain("watch_job.py", {"STEPS": "5", "TEARDOWN_ABORT_RANK": "1"})
    assert torchrun.returncode == 1 and "exitcode: -6" in torchrun.stderr, torchrun.stderr[-3000:]
    for steps in (5, 12):
        run = watch(
            ["--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")],
            tmp_path / str(steps),
            env={"STEPS": str(steps), "TEARDOWN_ABORT_RANK": "1"},
        )
        assert run.rc == 1, run.output
        assert "rank 1 ran past its process group" in run.output, run.output
        codes = [(f["code"], f["ranks"]) for f in run.report["findings"]]
        assert codes[0] == ("rank-crashed", [1]), codes
        assert "rank-exited" not in [c for c, _ in codes], codes
        crashed = run.report["findings"][0]
        assert crashed["steps"] == [steps], crashed
        ended = run.ended
        assert ended["failed"] is True and ended["steps"] == steps, ended
        rc, _, explained = explain(run.run_dir, tmp_path / str(steps))
        assert rc == 1 and explained is not None
        assert [(f["code"], f["ranks"]) for f in explained["findings"]] == codes
