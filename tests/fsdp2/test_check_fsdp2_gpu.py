"""`ddp-doctor check` on FSDP2 jobs on a GPU: plain fully_shard on NCCL, Accelerate's FSDP2 plugin and the HF Trainer
with `fsdp_version: 2`. Skipped without CUDA, as in CI: Accelerate uses FSDP only for GPU (and other accelerator)
processes and ignores its FSDP plugin on CPU (accelerate 1.15.0, state.py), and the Trainer's FSDP goes through it.

One rank each: the lent GPU machine has one GPU, and NCCL refuses two ranks on one device. On one rank the check
follows a sharded model too (its optimizer and its gradient sync can be wrong on one GPU as well), while the
cross-rank findings (parameters outside every group) have nothing to compare.

Ground truth, plain torchrun, one rank (the GPU run's log in benchmarks/gpu/, where the numbers are):
- fsdp2_cuda.py on NCCL: none moves the weights; optimizer-before and sync-off leave every weight where it was.
- accelerate_fsdp2.py: none (accumulate, get_state_dict on every process) trains; step-in-sync (the optimizer
  steps inside accelerator.no_sync(model)) moves no weight.
- trainer_fsdp2.py: the Trainer trains a 2-layer GPT-2 with FSDP2 for 12 steps.
- fsdp2_epochs.py --cuda: 3 epochs of 16 batches on NCCL, exit code 0 (with --no-set-epoch too, silently).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkrun import SCRIPTS, check, free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (NCCL, Accelerate's FSDP)")


def _check(tmp_path: Path, script: str, *args: str):
    # A port of its own: torchrun's default (29500) would make checks run side by side (pytest -n) collide.
    port = ["--master-port", str(free_port())]
    run = check(["--nproc-per-node", "1", *port, str(SCRIPTS / script), *args], tmp_path, timeout=240)
    assert run.report is not None and "parallelism" in run.report, run.output
    return run


@pytest.mark.parametrize(
    ("mistake", "code"),
    [("none", None), ("optimizer-before", "optimizer-params-replaced"), ("sync-off", "gradient-sync-off")],
)
def test_fully_shard_on_nccl(tmp_path: Path, mistake: str, code: str | None) -> None:
    run = _check(tmp_path, "fsdp2_cuda.py", "--mistake", mistake, "--backend", "nccl")
    assert run.report["parallelism"] == "fsdp2" and run.report["backend"] == "nccl", run.output
    assert run.codes == ({code} if code else set()), run.output
    assert run.rc == (1 if code else 0)


@pytest.mark.parametrize(("mistake", "code"), [("none", None), ("step-in-sync", "gradient-sync-off")])
def test_accelerate_fsdp2_plugin(tmp_path: Path, mistake: str, code: str | None) -> None:
    run = _check(tmp_path, "accelerate_fsdp2.py", "--mistake", mistake)
    assert run.report["parallelism"] == "fsdp2" and run.report["framework"] == "accelerate", run.output
    assert run.report["sharding"]["sharded_modules"] == 3 and run.report["sharding"]["root_sharded"]
    assert run.codes == ({code} if code else set()), run.output
    if code:
        assert "accelerator.no_sync(model)" in run.finding(code)["fix"]


def test_hf_trainer_fsdp_version_2(tmp_path: Path) -> None:
    run = _check(tmp_path, "trainer_fsdp2.py")
    assert run.report["parallelism"] == "fsdp2" and run.report["framework"] == "transformers", run.output
    assert run.report["sharding"]["root_sharded"] and run.codes == set(), run.output


@pytest.mark.parametrize(("mistake", "code"), [((), None), (("--no-set-epoch",), "sampler-epoch-not-set")])
def test_an_fsdp2_job_is_followed_through_its_epoch_end_on_nccl(tmp_path: Path, mistake, code) -> None:
    """tests/scripts/fsdp2_epochs.py on one NCCL rank: following's exchange and the sampler's epoch flag run on
    the GPU (their small tensors on `cuda:0`, the sharded model's device)."""
    run = _check(tmp_path, "fsdp2_epochs.py", "--cuda", "--out", str(tmp_path), *mistake)
    assert run.report["parallelism"] == "fsdp2" and run.report["backend"] == "nccl", run.output
    assert run.report["following"]["epoch_ends"] == 1, run.report["following"]
    serious = {f["code"] for f in run.report["findings"] if f["severity"] in ("error", "warning")}
    assert serious == ({code} if code else set()), run.output


@pytest.mark.parametrize(("mistake", "code"), [("none", None), ("step-in-sync", "gradient-sync-off")])
def test_accelerate_observe_follows_the_plugins_sharded_model(tmp_path: Path, mistake: str, code: str | None) -> None:
    """ddp_doctor.integrations.accelerate.observe around the loop of accelerate_fsdp2.py under plain torchrun (one
    rank): the model Accelerate's FSDP2 plugin sharded is followed by a ShardedDoctor, in Accelerate's words."""
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    command += ["--master-port", str(free_port()), str(SCRIPTS / "accelerate_fsdp2.py"), "--mistake", mistake]
    done = subprocess.run([*command, "--observe", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and out.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["parallelism"] == "fsdp2" and report["framework"] == "accelerate", report
    assert report["sharding"]["sharded_modules"] == 3 and report["sharding"]["root_sharded"]
    serious = {f["code"] for f in report["findings"] if f["severity"] in ("error", "warning")}
    assert serious == ({code} if code else set()), report["findings"]
    if code:
        assert "accelerator.no_sync(model)" in next(f for f in report["findings"] if f["code"] == code)["fix"]
