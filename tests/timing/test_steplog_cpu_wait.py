"""The sixth timing column: the time the training loop's thread waited for a CPU in each step (Linux's run-queue
delay, read from /proc/self/task/<tid>/schedstat), which straggler-rank leaves out of a rank's own time."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ddp_doctor.core.records import TIMING_COLUMNS
from ddp_doctor.observation.steplog import StepLog, StepState

PATH = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")


@pytest.mark.skipif(not PATH.exists(), reason="no schedstat here (not Linux, or a kernel without it)")
def test_each_step_records_the_loop_threads_wait_for_a_cpu_from_schedstat() -> None:
    # Read before the log is made: the log takes its own first reading when it is made, and the thread may wait
    # for a CPU between the two (CI failed on a bound taken after it: 26 us counted, 0 us allowed).
    before = int(PATH.read_text().split()[1]) / 1e9
    log = StepLog([torch.nn.Parameter(torch.ones(3))], [])
    assert log._schedstat == str(PATH)
    now = log._runq_now()
    # Read from this thread's counter (not the 0.0 fallback): between two readings it only grows, by little.
    assert before <= now <= int(PATH.read_text().split()[1]) / 1e9 and now - before < 1.0
    log.close(StepState(1), complete=True)
    row = log._rows["timing"][-1]
    assert row.shape == (TIMING_COLUMNS,) and float(row[5]) >= 0.0
    assert float(row[5]) <= log._runq_now() - before + 1e-9
