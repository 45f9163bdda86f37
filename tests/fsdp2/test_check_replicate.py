"""`ddp-doctor check` on jobs built with the FSDP2-based `replicate` (torch.distributed._composable.replicate_with_fsdp),
tests/scripts/replicate_train.py.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 optimizer steps of two micro-batches; every run
ends with exit code 0 and prints nothing but its own line per rank. `replicate` makes each module a `ReplicateModule`
(a subclass of FSDP2's `FSDPModule`) whose parameters are DTensors with a Replicate placement: every rank holds the
whole tensor.
- none: the weights move (largest change 0.109), the head's weight sums are equal on both ranks (-1.496532).
- optimizer-before (the optimizer built before replicate): largest weight change 0 on both ranks.
- root-unreplicated (the blocks replicated, the root with its head not): head.weight sums -2.187345 and -2.443114.
- sync-off (set_requires_gradient_sync(False) on every micro-batch, never back on): largest weight change 0.
- eval-rank0 (rank 0 alone runs a forward under no_grad after the third step): runs to the end, sums equal
  (-1.401586): unlike fully_shard's all-gathers, replicate's forward makes no collective.
- --save rank0 (rank 0 alone: torch.save(model.state_dict())): the file holds DTensors with the whole tensor
  (head.weight local [4, 64] = global); loading it into the plain Net raises "aten.copy_.default got mixed
  torch.Tensor and DTensor", `.to_local()` on every value loads, and loading it into a replicated Net on both ranks
  works. Not an incomplete checkpoint.
- skip-rank1 (rank 1 alone skips optimizer.step() at the third step): the replicas differ (head.weight -1.458571 on
  rank 0, -1.529048 on rank 1). Under the check, rank 0 reaches the 8th step first and waits in the report while
  rank 1 waits in its next backward's all-reduce; the failure report named a collective-mismatch ("rank 0 skipped
  all_reduce") before it read the steps and forwards each rank counted.
- buffer-rank (a constant buffer scaling the head's input, drawn from each rank's own seed): the weights agree
  (head.weight sums -1.917412 on both ranks) while the buffer stays each rank's (sums 30.096731 and 33.989311 at the
  end): replicate takes parameters only and broadcasts no buffer, so each rank computes another function. The
  check compared buffers for fully_shard only (its note said replicate broadcasts them), and called this job clean.
  buffer-same (one seed): 30.096731 on both ranks.
Before the check knew replicate, it reported these jobs as fully_shard ones ("FSDP2: 3 sharded modules").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

SCRIPT = str(SCRIPTS / "replicate_train.py")


def test_a_clean_replicate_job_is_clean_and_named_replicate(tmp_path: Path) -> None:
    """The clean job with what would be mistakes under fully_shard but are not under replicate: an evaluation
    forward on rank 0 alone, and rank 0 alone saving the state dict (every value is in it); and an evaluation on
    every rank after the last of 6 steps, which leaves the root's parameters unsharded when the report reads them."""
    args = ["--mistake", "eval-rank0,final-eval", "--steps", "6", "--save", "rank0", "--save-dir", str(tmp_path)]
    run = check(["--nproc-per-node", "2", SCRIPT, *args], tmp_path, timeout=180)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    assert run.report["parallelism"] == "replicate"
    sharding = run.report["sharding"]
    assert sharding["api"] == "replicate" and sharding["sharded_modules"] == 3 and sharding["root_sharded"]
    assert "replicate (FSDP2): 3 replicated" in run.output and "modules (root replicated), mesh" in run.output
    assert "reshard_after_forward" not in run.output
    assert "This job replicates its model with FSDP2's replicate" in run.report["recommendation"]["reason"]
    assert (tmp_path / "ck.pt").is_file()


@pytest.mark.parametrize(
    ("mistake", "code", "words"),
    [
        ("optimizer-before", "optimizer-params-replaced", "build the optimizer after every replicate call"),
        ("root-unreplicated", "unsharded-params-not-synced", "the root module was not replicated"),
        ("sync-off", "gradient-sync-off", "replicate then all-reduces no gradient"),
    ],
)
def test_a_replicate_mistake_gets_its_code_in_replicate_words(
    tmp_path: Path, mistake: str, code: str, words: str
) -> None:
    run = check(["--nproc-per-node", "2", SCRIPT, "--mistake", mistake], tmp_path, timeout=180)
    assert run.rc == 1 and run.codes == {code}, run.output
    assert run.report["parallelism"] == "replicate"
    finding = run.finding(code)
    assert words in finding["detail"] + finding["fix"], finding
    assert "fully_shard" not in finding["detail"] + finding["fix"] + finding["title"], finding
    if mistake == "root-unreplicated":
        assert [p["name"] for p in finding["params"]] == ["head.weight", "head.bias"]
        assert finding["severity"] == "error" and "0.23" in finding["detail"]
    if mistake == "optimizer-before":
        lines = Path(SCRIPT).read_text().splitlines()
        line = next(i for i, text in enumerate(lines, 1) if "opt = torch.optim.AdamW" in text)  # the first: before
        assert f"AdamW created at tests/scripts/replicate_train.py:{line}" in finding["detail"]


def test_a_step_rank_1_alone_skips_is_optimizer_step_skipped_not_a_collective_rank_0_skipped(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", "--no-verify", SCRIPT, "--mistake", "skip-rank1"], tmp_path, timeout=180)
    assert run.rc == 1 and run.codes == {"optimizer-step-skipped"}, run.output
    f = run.finding("optimizer-step-skipped")
    measured = {m["name"]: m["value"] for m in f["measured"]}
    assert (measured["optimizer_steps_rank_0"], measured["optimizer_steps_rank_1"]) == (8, 7), measured
    assert measured["forwards_rank_1"] > measured["forwards_rank_0"], measured
    assert run.report["parallelism"] == "replicate" and run.report["failed"] is True


@pytest.mark.parametrize("mistake", ["buffer-rank", "buffer-same"])
def test_a_buffer_that_differs_across_replicas_is_named(tmp_path: Path, mistake: str) -> None:
    run = check(["--nproc-per-node", "2", SCRIPT, "--mistake", mistake], tmp_path, timeout=180)
    assert run.report["compared"]["buffers"] == 1, run.report["compared"]
    if mistake == "buffer-same":
        assert run.rc == 0 and run.codes == set(), run.output
        return
    assert run.rc == 1 and run.codes == {"buffer-divergence"}, run.output
    found = run.finding("buffer-divergence")
    assert found["severity"] == "error" and run.params("buffer-divergence") == {"mix"}, found
    assert found["ranks"] == [0, 1] and found["steps"] == list(range(8)), found
