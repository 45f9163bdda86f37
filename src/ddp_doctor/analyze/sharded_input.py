"""`input-bound` for a sharded model (FSDP2's `fully_shard`, `replicate`): every rank waits for its next batch for
most of each step. Pure: the agreed facts (`ShardedRun.input_wait`) in.

DDP's rule reads each rank's step phases from DDP's hooks (`analyze/throughput.py`); a sharded model has none, so
the watch times its steps from the host's clock (`observation/step_clock.py`): from one optimizer step's end to the
first forward after it (the wait), and to the next step's end (the step), on CPU only. The same thresholds decide
(`core/steptime.waits_for_data_at`), and on every rank, not on more than half of them: the reduction carries the
lowest and highest of each rank's figures, not their median.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_slow_loader.py`, a dataset
that sleeps 5 ms per sample, 8 samples per batch): with no worker the ranks waited 42 ms of a 70 ms step (the
script's own clock); with 4 workers 2 ms of 27 ms. Both end with exit code 0 (tests/launch/test_check_fsdp2_steps.py).
"""

from __future__ import annotations

from ddp_doctor.analyze.throughput import input_fix, loader_words
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.sharded_run import ShardedRun

__all__ = ["sharded_input_bound"]


def _ms(lo: float, hi: float) -> str:
    return f"{lo * 1e3:.1f} ms" if round(lo * 1e3, 1) == round(hi * 1e3, 1) else f"{lo * 1e3:.1f}-{hi * 1e3:.1f} ms"


def sharded_input_bound(run: ShardedRun, ranks: list[int]) -> Finding:
    """The finding for `run.input_wait` (set)."""
    w = run.input_wait
    assert w is not None
    (wait_lo, wait_hi), (step_lo, step_hi) = w["wait_s"], w["step_s"]
    share = wait_lo / step_hi if step_hi > 0 else 1.0
    loader = w["loader"]
    name, settings = loader_words(loader)
    return Finding(
        code=Code.INPUT_BOUND,
        severity="warning",
        title=f"every rank waits for data at least {share:.0%} of each step ({_ms(wait_lo, wait_hi)} of "
        f"{_ms(step_lo, step_hi)})",
        detail=f"Measured on this machine's clock over {w['steps']} steps (the first observed step left out): each "
        f"rank's median wait between the end of one optimizer step and the next forward is {_ms(wait_lo, wait_hi)}, "
        f"of a median step of {_ms(step_lo, step_hi)} (the lowest and highest over the ranks). The input comes from "
        f"{name}" + (f" ({settings})" if settings else "") + ". That time is spent in the loader's __next__ and "
        "whatever else the loop does between steps; more GPUs will not make the run faster until it shrinks.",
        ranks=ranks,
        steps=[],
        fix=input_fix(loader.get("num_workers")),
    )
