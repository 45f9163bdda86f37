"""An abort at interpreter exit after the script's last line is told apart from a failure of the script.

tests/scripts/abort_at_exit.py trains 3 steps, writes `rank{R}.done`, and rank 1 then calls the native
`std::terminate()` from an atexit hook: the message and the SIGABRT of torch 2.13's gloo quirk at exit ("terminate
called without an active exception", seen in up to half the runs of some small scripts here, docs/fixes.md).
Under plain torchrun: exit code 1, rank 1 `exitcode -6 (SIGABRT)`, rank 0 `-15` (torchrun's SIGTERM), and both
`.done` files written. With --raise the script fails before its end (exit code 1, rank exit codes 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from checkrun import REPO, SCRIPTS, check
from frameworkrun import torchrun


def test_plain_torchrun_tells_the_abort_at_exit_from_a_failure(tmp_path: Path) -> None:
    ended = torchrun("abort_at_exit.py", [str(tmp_path / "ended")], tmp_path)
    assert ended.rc != 0 and ended.aborted_at_exit and ended.finished, ended.output[-3000:]
    assert sorted(p.name for p in (tmp_path / "ended").iterdir()) == ["rank0.done", "rank1.done"]
    failed = torchrun("abort_at_exit.py", [str(tmp_path / "failed"), "--raise"], tmp_path)
    assert failed.rc != 0 and not failed.aborted_at_exit and not failed.finished, failed.output[-3000:]


def test_under_the_check_the_ranks_never_reach_interpreter_exit(tmp_path: Path) -> None:
    """The check's ranks end with os._exit once their report is written: the script's atexit hooks (and the
    interpreter's finalization, where gloo's quirk aborts) never run, so the abort cannot turn a clean report into a
    crash."""
    run = check(
        ["--nproc-per-node", "2", "--steps", "2", str(SCRIPTS / "abort_at_exit.py"), str(tmp_path / "o")], tmp_path
    )
    assert run.rc == 0 and run.codes == set(), run.output
    assert "terminate called" not in run.output


def test_under_watch_an_abort_at_exit_after_the_last_line_is_said_as_such(tmp_path: Path) -> None:
    """`watch` lets the script end as it would (its atexit hooks run), so the abort happens there as under plain
    torchrun: the summary says the script ran to its end and which rank aborted at interpreter exit, the exit code
    is 0 when every rank had ended its script; a failure before the end (--raise) is a failed job."""
    for name, extra, rc in (("ended", [], 0), ("failed", ["--raise"], 1)):
        run_dir = tmp_path / f"run-{name}"
        done = subprocess.run(
            [sys.executable, "-m", "ddp_doctor.cli", "watch", "--run-dir", str(run_dir), "--nproc-per-node", "2"]
            + ["--steps", "2", str(SCRIPTS / "abort_at_exit.py"), str(tmp_path / name), *extra],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
        )
        ended = json.loads((run_dir / "watch.json").read_text())
        assert done.returncode == rc, done.stdout[-3000:] + done.stderr[-3000:]
        assert ended["failed"] is bool(rc), ended["summary"]
        if not rc:
            assert "rank 1 aborted at interpreter exit" in ended["summary"], ended["summary"]
            assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["rank0.done", "rank1.done"]
