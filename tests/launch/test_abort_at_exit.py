"""An abort at interpreter exit after the script's last line is told apart from a failure of the script.

tests/scripts/abort_at_exit.py trains 3 steps, writes `rank{R}.done`, and rank 1 then calls the native
`std::terminate()` from an atexit hook: the message and the SIGABRT of torch 2.13's gloo quirk at exit ("terminate
called without an active exception", seen in up to half the runs of some small scripts here, docs/fixes.md).
Under plain torchrun: exit code 1, rank 1 `exitcode -6 (SIGABRT)`, rank 0 `-15` (torchrun's SIGTERM), and both
`.done` files written. With --raise the script fails before its end (exit code 1, rank exit codes 1).
"""

from __future__ import annotations

from pathlib import Path

from checkrun import SCRIPTS, check
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
