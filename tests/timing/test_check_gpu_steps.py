"""`input-bound` on a GPU, from the GPU's clock (`observation/device_clock.py`): DDP with `device_ids` and FSDP2 on
one NCCL rank, and DDP on two ranks sharing the GPU over gloo (tests/scripts/gpu_input.py, which logs
`loss.item()` after every optimizer step). Skipped without CUDA, as in CI.

Ground truth, plain torchrun, one H100, torch 2.11.0+cu130, NCCL 2.28.9, 2026-11-26 (benchmarks/gpu/steps.sh; the
log in benchmarks/gpu/steps_gpu_2026-11-26.log), 24 steps, the script's own clocks, medians over the steps after the
first (the host's time from `optimizer.step()` returning to the next forward; the loader's `__next__` alone; the
GPU's step and its idle time before the forward, from CUDA events):
- DDP, slow loader (5 ms per sample, 8 samples, no worker): host 42.0 ms, `__next__` 41.6 ms, GPU step 44.8 ms,
  GPU idle 42.0 ms: the GPU waits for its data.
- DDP, in-memory batches, 12 4096-wide layers: host 24.5 ms, `__next__` 3.9 ms, GPU step 31.8 ms, GPU idle 4.3 ms:
  the GPU is busy; the host's 24.5 ms (77% of the step, over the 50% the rule asks) is mostly its wait in
  `loss.item()` for the GPU.
- FSDP2, slow loader: host 42.0, `__next__` 41.5, GPU step 47.9, GPU idle 41.9 ms. FSDP2, in memory: host 6.2,
  `__next__` 2.4, GPU step 31.9, GPU idle 2.6 ms.
- DDP on two ranks sharing the GPU over gloo, slow loader: rank 0 host 42.1, `__next__` 41.5, GPU step 45.3, GPU
  idle 41.9 ms.
Every run ended with exit code 0.

Under the check (same machine): DDP in memory, the GPU idle 4.4 ms of a 54.0 ms step. Its first version marked a
step's end before the doctor's own work on it (its fingerprints of the weights): 15.3 ms of 54.7 then, so the mark
now follows that work.

Before the GPU's clock, neither rule ran for a model on CUDA: the host's wait between steps holds its wait in
`loss.item()` for a busy GPU, so the host's clock would have called the busy job input-bound. The tests assert no
timing, only what the thresholds decide.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkrun import SCRIPTS, check, free_port

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA events, NCCL)"),
    pytest.mark.serial,  # verdicts measured on the clock: run alone
]

SCRIPT = str(SCRIPTS / "gpu_input.py")


def _check(tmp_path: Path, *args: str, nproc: int = 1, backend: str = "nccl"):
    port = ["--master-port", str(free_port())]
    launch = ["--nproc-per-node", str(nproc), *port, "--no-verify"]
    run = check([*launch, SCRIPT, *args, "--backend", backend], tmp_path, timeout=240)
    assert run.report is not None, run.output
    return run


@pytest.mark.parametrize("api", ["ddp", "fsdp2"])
def test_a_gpu_waiting_for_a_slow_loader_is_input_bound_on_the_gpus_clock(tmp_path: Path, api: str) -> None:
    run = _check(tmp_path, "--api", api, "--loader", "slow")
    assert run.codes == {"input-bound"}, run.output
    finding = run.finding("input-bound")
    assert "the GPU's clock" in finding["detail"], finding
    assert "SlowDecode created at tests/scripts/gpu_input.py:" in finding["detail"], finding


@pytest.mark.parametrize("api", ["ddp", "fsdp2"])
def test_a_busy_gpu_whose_host_waits_in_loss_item_is_not_input_bound(tmp_path: Path, api: str) -> None:
    run = _check(tmp_path, "--api", api, "--loader", "fast")
    assert run.codes == set(), run.output
    if api == "ddp":
        (rank0,) = run.report["timing"]["per_rank"]
        assert rank0["clock"] == "gpu" and rank0["data_wait_s"] < 0.2 * rank0["step_s"], rank0
    else:
        assert "the GPU's clock over" in run.report["recommendation"]["reason"], run.output


def test_two_ddp_ranks_sharing_the_gpu_over_gloo_are_input_bound(tmp_path: Path) -> None:
    run = _check(tmp_path, "--api", "ddp", "--loader", "slow", nproc=2, backend="gloo")
    assert run.codes == {"input-bound"}, run.output
    assert run.finding("input-bound")["ranks"] == [0, 1]
    assert {r["clock"] for r in run.report["timing"]["per_rank"]} == {"gpu"}
