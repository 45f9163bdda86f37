"""`input-bound` on a GPU, from the GPU's clock (`observation/device_clock.py`): DDP with `device_ids` and FSDP2 on
one NCCL rank, and DDP on two ranks sharing the GPU over gloo (tests/scripts/gpu_input.py, which logs
`loss.item()` after every optimizer step). Skipped without CUDA, as in CI.

Ground truth, plain torchrun, GPU_TRUTH.

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
