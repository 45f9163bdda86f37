"""The script's own error on every rank at once (tests/scripts/script_raises.py: a ValueError at the start of
step 3 on both ranks). Ground truth under plain torchrun, 2 ranks, torch 2.13 on gloo: exit 1 for DDP, FSDP2's
fully_shard and replicate alike, both ranks print the ValueError's traceback; `--exit 3` (sys.exit(3) on every
rank): exit 1; `--exit 0`: exit 0 (a short script, which stays clean). The check said "No problems found" with exit 0 under DDP for the error and for
sys.exit(3) (every rank ended in the same step, so the ranks exchanged the 3 steps they had closed and no finding
spoke of the end), and one `rank-crashed` finding per rank under FSDP2 (1,000 boxes at 1,000 ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

pytestmark = pytest.mark.timeout(300)

SCRIPT = SCRIPTS / "script_raises.py"
RAISE_LINE = next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "raise ValueError" in line)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])  # replicate takes FSDP2's road (checked by hand alike)
def test_every_rank_raising_is_one_crash_finding_and_exit_1(tmp_path: Path, wrap: str) -> None:
    run = check(["--nproc-per-node", "2", "--no-verify", str(SCRIPT), "--wrap", wrap], tmp_path)
    assert run.rc == 1, run.output
    assert [f["code"] for f in run.report["findings"]] == ["rank-crashed"], run.output
    finding = run.finding("rank-crashed")
    # torchrun stops the other ranks as soon as one fails (under plain torchrun too): on a loaded machine an FSDP2
    # rank, which has no exchange to wait in, can be stopped before it reaches the raise (seen once in CI: rank 0
    # stopped at step 2). The crash is still one finding; DDP's ranks wait in the exchange and both are named.
    assert finding["ranks"] in ([0, 1], [0], [1]) and finding["steps"] == [3], finding
    assert wrap != "ddp" or finding["ranks"] == [0, 1], finding
    assert finding["sites"] == [f"tests/scripts/script_raises.py:{RAISE_LINE}"], finding
    assert "ValueError" in finding["title"]
    if wrap == "ddp":
        # The ranks still compared the steps they closed: the report covers them, and its crashes carry the line.
        assert run.report["steps_observed"] == 3 and run.report["compared"]["steps"] == 3, run.output
        crashes = run.report["crashes"]
        assert [(c["rank"], c["step"], c["kind"]) for c in crashes] == [(0, 3, "other"), (1, 3, "other")], crashes
        assert all(c["site"].startswith(f"tests/scripts/script_raises.py:{RAISE_LINE}") for c in crashes), crashes


def test_error_before_the_first_step_says_nothing_was_compared(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", "--no-verify", str(SCRIPT), "--at", "0"], tmp_path)
    assert run.rc == 1, run.output
    finding = run.finding("rank-crashed")
    assert finding["ranks"] == [0, 1] and finding["steps"] == [0], finding
    assert run.report["steps_observed"] == 0


def test_every_rank_exiting_with_a_failure_status_fails_the_check(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", "--no-verify", str(SCRIPT), "--exit", "3"], tmp_path)
    exit_line = next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "sys.exit(args.exit)" in line)
    assert run.rc == 1, run.output
    assert [f["code"] for f in run.report["findings"]] == ["rank-crashed"], run.output
    finding = run.finding("rank-crashed")
    assert finding["ranks"] == [0, 1] and finding["steps"] == [3], finding
    assert finding["sites"] == [f"tests/scripts/script_raises.py:{exit_line}"], finding
    assert [c["kind"] for c in run.report["crashes"]] == ["exit", "exit"], run.report["crashes"]
