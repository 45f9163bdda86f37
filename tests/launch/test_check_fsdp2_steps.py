"""Where an FSDP2 job's step time goes: `input-bound` from the host's clock (tests/scripts/fsdp2_slow_loader.py, a
dataset that sleeps 5 ms per sample, 8 samples per batch, `fully_shard` on the first Linear and the root).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 24 steps, the script's own clock (median per rank),
on this 2-core machine while a benchmark ran beside it: with no worker the ranks waited 42.3 and 42.1 ms of a 70.0
and 69.6 ms step; with 4 workers (prefetch 4) 2.1 and 1.7 ms of 26.8 and 27.5 ms. Both runs end with exit code 0.
Before the check timed sharded models, neither was named: "the step time" was in the report's list of what it did
not check for FSDP2.

The thresholds are DDP's (`core/steptime.waits_for_data_at`), on every rank; the test asserts no timing, only what
the thresholds decide (a 5 ms sleep per sample is a wait of at least 40 ms per step without workers; with 2 ms,
the first version of this test once fell short of them while other jobs loaded the machine).
"""

from __future__ import annotations

from pathlib import Path

from checkrun import SCRIPTS, check

SCRIPT = str(SCRIPTS / "fsdp2_slow_loader.py")


def _check(tmp_path: Path, workers: int):
    return check(["--nproc-per-node", "2", "--no-verify", SCRIPT, "--workers", str(workers)], tmp_path, timeout=180)


def test_every_rank_waiting_for_its_batches_is_input_bound_with_the_loader_and_its_line(tmp_path: Path) -> None:
    run = _check(tmp_path, 0)
    assert run.rc == 0 and run.codes == {"input-bound"}, run.output
    finding = run.finding("input-bound")
    assert finding["severity"] == "warning" and finding["ranks"] == [0, 1]
    assert "the DataLoader over SlowDecode created at tests/scripts/fsdp2_slow_loader.py:34" in finding["detail"]
    assert "num_workers=0" in finding["detail"] and "give it worker processes" in finding["fix"]
    reason = run.report["recommendation"]["reason"]
    assert "whether the ranks wait for their data (the host's clock over 7 steps)" in reason
    assert "a straggler rank (the wait in the sharded model's communication is not timed)" in reason


def test_a_loader_with_workers_keeps_up_and_is_clean(tmp_path: Path) -> None:
    run = _check(tmp_path, 4)
    assert run.rc == 0 and run.report["findings"] == [], run.output
