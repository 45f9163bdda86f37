"""`ddp-doctor watch` when the script raises its own error after the observed steps' report (tests/scripts/
script_raises.py, `--at 9` with 4 observed steps), on one rank or on every rank, or calls sys.exit(3) on every rank.

Ground truth under plain torchrun, 2 ranks, torch 2.13 on gloo: exit 1 every way. `--rank 1`: rank 1's
ValueError, and rank 0 raises gloo's *Connection closed by peer* in its next gradient all-reduce (the backward at
the script's `loss.backward()`). Every rank: both print the ValueError.

Under `watch` the job's report said "No problems found" after "the job failed" (the crash came after the report
was made, and a rank's crash there was not read as a crash at all; every rank's sys.exit(3) at one step read as a
script that is just short): the cause reached nobody but the traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS
from watchrun import explain, watch

pytestmark = pytest.mark.timeout(300)

SCRIPT = SCRIPTS / "script_raises.py"
RAISE_LINE = next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "raise ValueError" in line)


def test_an_error_after_the_report_is_the_job_failure(tmp_path: Path) -> None:
    """On rank 1 alone. (Every rank raising is grouped into one finding by the same failure analysis, tested under
    `check` on an FSDP2 job, which ends the same way.)"""
    ranks = [1]
    args = ["--nproc-per-node", "2", "--steps", "4", str(SCRIPT), "--at", "9", "--rank", "1"]
    run = watch(args, tmp_path)
    assert run.rc == 1, run.output
    findings = run.report["findings"]
    assert [(f["code"], f["ranks"], f["steps"]) for f in findings] == [("rank-crashed", ranks, [9])], run.output
    assert findings[0]["sites"] == [f"tests/scripts/script_raises.py:{RAISE_LINE}"], findings[0]
    assert run.report["steps_observed"] == 4
    ended = run.ended
    assert ended["failed"] is True, ended
    rc, _, explained = explain(run.run_dir, tmp_path)
    assert rc == 1 and explained is not None
    assert [(f["code"], f["ranks"]) for f in explained["findings"]] == [("rank-crashed", ranks)]


def test_every_rank_exiting_with_a_failure_status_after_the_report_is_the_job_failure(tmp_path: Path) -> None:
    run = watch(["--nproc-per-node", "2", "--steps", "4", str(SCRIPT), "--at", "9", "--exit", "3"], tmp_path)
    assert run.rc == 1, run.output
    findings = run.report["findings"]
    assert [(f["code"], f["ranks"], f["steps"]) for f in findings] == [("rank-crashed", [0, 1], [9])], run.output
    assert run.ended["failed"] is True, run.ended
