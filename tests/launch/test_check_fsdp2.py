"""`ddp-doctor check` on jobs that shard with FSDP2 (`fully_shard`) instead of DDP (tests/scripts/fsdp2_train.py).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 optimizer steps of two micro-batches; every run
ends with exit code 0 and prints nothing but its own line per rank:
- none / accumulate (sync off for the first micro-batch, on for the last): the weights move (largest change 0.109)
  and the head's weight sums are equal on both ranks (-1.496532).
- optimizer-before (the optimizer built before fully_shard): largest weight change 0 on both ranks.
- sync-off (set_requires_gradient_sync(False) on every micro-batch, never back on): largest weight change 0.
- root-unsharded (the blocks sharded, the root with its head not): head.weight sums -2.187345 and -2.443114.
- added-after (everything sharded, then `model.extra = nn.Linear(64, 64)` trained): extra.weight sums -12.648243
  and -1.867362; the sharded head stays equal (-0.749989).
Before the check knew FSDP2, it crashed every one of these jobs in its own fingerprint code ("aten.mul.Tensor got
mixed torch.Tensor and DTensor") and blamed the script.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

SCRIPT = str(SCRIPTS / "fsdp2_train.py")


def _check(tmp_path: Path, mistake: str, ranks: int = 2):
    return check(["--nproc-per-node", str(ranks), SCRIPT, "--mistake", mistake], tmp_path, timeout=180)


@pytest.mark.parametrize("mistake", ["none", "accumulate"])
def test_a_clean_fsdp2_job_is_clean_and_its_sharding_is_named(tmp_path: Path, mistake: str) -> None:
    run = _check(tmp_path, mistake)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    assert run.report["parallelism"] == "fsdp2"
    sharding = run.report["sharding"]
    assert sharding["sharded_modules"] == 3 and sharding["root_sharded"] and sharding["mesh"] == [[2]]
    assert "FSDP2: 3 sharded modules" in run.output and "No problems found in what was checked" in run.output
    assert "Not checked for FSDP2 yet: checkpoints" in run.report["recommendation"]["reason"]
    assert run.report["steps_observed"] == 8  # the script trains 12 steps; the check stops it after --steps
    assert run.report["recommendation"]["flags_known"] is False and run.report["recommendation"]["static_graph"] is None


def test_an_optimizer_built_before_fully_shard_is_named_with_its_line(tmp_path: Path) -> None:
    run = _check(tmp_path, "optimizer-before")
    assert run.rc == 1 and run.codes == {"optimizer-params-replaced"}, run.output
    finding = run.finding("optimizer-params-replaced")
    assert finding["severity"] == "error" and finding["ranks"] == [0, 1]
    assert "AdamW created at tests/scripts/fsdp2_train.py:49" in finding["detail"]
    assert "not one of the model's 6 trainable parameters changed" in finding["detail"]
    assert "after every fully_shard call" in finding["fix"]


def test_gradient_sync_never_switched_back_on_is_named_with_its_line(tmp_path: Path) -> None:
    run = _check(tmp_path, "sync-off")
    assert run.rc == 1 and run.codes == {"gradient-sync-off"}, run.output
    finding = run.finding("gradient-sync-off")
    assert "tests/scripts/fsdp2_train.py:63" in finding["detail"] and "changed on any rank" in finding["detail"]
    assert "set_requires_gradient_sync(micro_step == accumulation_steps - 1)" in finding["fix"]


@pytest.mark.parametrize(
    "mistake, ranks, params, cause",
    [
        ("root-unsharded", 2, {"head.weight", "head.bias"}, "the root module was not sharded"),
        ("root-unsharded", 4, {"head.weight", "head.bias"}, "the root module was not sharded"),
        ("added-after", 2, {"extra.weight", "extra.bias"}, "a module added after sharding"),
    ],
)
def test_parameters_outside_every_group_that_differ_are_named(tmp_path, mistake, ranks, params, cause) -> None:
    run = _check(tmp_path, mistake, ranks)
    assert run.rc == 1 and run.codes == {"unsharded-params-not-synced"}, run.output
    finding = run.finding("unsharded-params-not-synced")
    assert finding["severity"] == "error" and finding["ranks"] == list(range(ranks))
    assert run.params("unsharded-params-not-synced") == params
    assert cause in finding["detail"] and "fully_shard" in finding["fix"]
