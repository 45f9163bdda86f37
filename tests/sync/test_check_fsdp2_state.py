"""FSDP2: the optimizer's settings and the modules' train/eval modes compared across ranks at each observed step
(`PlainOptimizerWatch.replica_state`, one min/max of digests; `analyze/replica_state.py`, DDP's rule).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps of tests/scripts/fsdp2_train.py:
- `--mistake sched-rank0` (StepLR, gamma 0.5, stepped on rank 0 alone from the third step): exit code 0, nothing
  said; the last learning rate is 9.77e-06 on rank 0 and 0.01 on rank 1; the gathered head.weight sums to -0.952121
  on both ranks, against -1.060282 with the scheduler stepped on every rank (`sched-every`).
- `--mistake plateau-local` (ReduceLROnPlateau stepped on every rank with the rank's own loss): exit code 0,
  nothing said; the learning rates part at the sixth step (0.0025 on rank 0, 0.005 on rank 1) and meet again at
  0.000313 by the twelfth: in between each rank stepped its own shards at its own rate.
- `--mistake train-rank0` (a Dropout in the first block; every rank evaluates in eval mode after the third step,
  rank 0 alone calls `model.train()` after): exit code 0, nothing said; rank 1 ends with `training` False and
  head.weight sums to -1.407930, against -1.468885 with every rank back in train mode (`train-every`).
- `--mistake skip-rank1` (rank 1 alone skips `optimizer.step()` at the third step, as a skip decided from its own
  loss would): exit code 0, nothing said; the gathered head.weight sums to -1.745120 on both ranks, against
  -1.496532 when every rank steps (the shards rank 1 holds are one update behind). Under the check, rank 0 reaches
  the 8th observed step first and waits in the report while rank 1, at its 7th, waits in its next forward's
  all-gather: the check cannot compare, and names the skip from the counts each rank left.
- `--mistake log-op-rank0` (every rank all_reduces its loss after each step to log it, rank 0 with op=MAX, the
  others with the default SUM): exit code 0, nothing said; at the last step rank 1's loss is 1.445838 and the SUM it
  asked for came back as 1.461524, rank 0's loss (the MAX): gloo applied one rank's reduction for both.
- `--mistake log-dtype-rank0` (the same all_reduce, rank 0's in float64): rank 1 dies of SIGABRT in gloo at the
  first step (exit code -6), and torchrun ends the job.
- `--mistake temperature` (a learnable loss temperature `temp = nn.Parameter(...)` kept beside the model and stepped
  by the same AdamW): exit code 0, nothing said; head.weight is equal on both ranks, the temperature ends at
  0.071670 on rank 0 and 0.038691 on rank 1. Before, the check said "No problems found" and claimed to have compared
  "the optimizer's parameters against the model's". With the script averaging `temp.grad` before each step
  (`temperature-synced`): 0.073942 on both ranks. Stepped by an SGD of its own (`temperature-own-opt`): 0.121164 on
  rank 0, 0.086329 on rank 1.
- `--mistake frozen-model,temperature` (every parameter of the model frozen, the temperature the only tensor the
  optimizer steps: a prompt tuned on a frozen model): exit code 0, nothing said; the model's weights do not move
  (head.weight -0.703294 on both ranks), the temperature ends at 0.052637 on rank 0 and -0.021144 on rank 1; with its
  gradient averaged (`frozen-model,temperature-synced`) at 0.015132 on both. The check called both a stale
  optimizer (`optimizer-params-replaced` at error: "the optimizer steps 1 parameters that are no longer the
  model's"), the synced one included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check, line_of

SCRIPT = str(SCRIPTS / "fsdp2_train.py")
FSDP2_CALLS_PER_STEP = 16
"""FSDP2's own collectives in one step of fsdp2_train.py (2 micro-batches, each 3 forward all-gathers, 2 backward
re-gathers of the resharded blocks and 3 reduce-scatters), counted and compared with the script's."""


def _check(tmp_path: Path, mistake: str):
    return check(["--nproc-per-node", "2", "--no-verify", SCRIPT, "--mistake", mistake], tmp_path, timeout=240)


def test_a_scheduler_stepped_on_rank_0_alone_is_optimizer_differs_at_the_first_step_it_shows(tmp_path: Path) -> None:
    run = _check(tmp_path, "sched-rank0")
    assert run.rc == 1 and run.codes == {"optimizer-differs"}, run.output
    f = run.finding("optimizer-differs")
    # the scheduler first stepped after step 2 (0-based) on rank 0: step 3 ran at two learning rates
    assert (f["severity"], f["ranks"], f["steps"]) == ("error", [0, 1], [3]), f
    assert run.report["compared"]["state_steps"] == 8, run.report["compared"]


def test_a_plateau_scheduler_given_each_ranks_own_loss_is_named_with_its_line_and_fix(tmp_path: Path) -> None:
    run = _check(tmp_path, "plateau-local")
    assert run.rc == 1 and run.codes == {"optimizer-differs"}, run.output
    f = run.finding("optimizer-differs")
    assert f["sites"] == [f"tests/scripts/fsdp2_train.py:{line_of(SCRIPT, 'plateau.step(loss.item())')}"], f


def test_a_model_left_in_eval_mode_on_rank_1_is_named_at_the_first_step_it_trained_so(tmp_path: Path) -> None:
    run = _check(tmp_path, "train-rank0")
    assert run.rc == 0 and run.codes == {"replica-divergence"}, run.output
    f = run.finding("replica-divergence")
    assert (f["severity"], f["ranks"], f["steps"]) == ("warning", [0, 1], [3]), f


def test_a_scheduler_and_an_evaluation_on_every_rank_are_clean_and_counted(tmp_path: Path) -> None:
    run = _check(tmp_path, "sched-every,train-every")
    assert run.rc == 0 and run.codes == set(), run.output
    compared = run.report["compared"]
    # 8 observed steps; the root, two blocks of Linear/ReLU (and the first block's Dropout), the head
    assert (compared["state_steps"], compared["modules"]) == (8, 10), compared


def test_a_step_rank_1_alone_skips_is_optimizer_step_skipped_from_the_counts_each_rank_left(tmp_path: Path) -> None:
    run = _check(tmp_path, "skip-rank1")
    assert run.rc == 1 and run.codes == {"optimizer-step-skipped"}, run.output
    assert run.report["failed"] is True  # a report from each rank's files: nothing compared across ranks
    f = run.finding("optimizer-step-skipped")
    assert (f["severity"], f["ranks"]) == ("error", [0, 1]), f
    measured = {m["name"]: m["value"] for m in f["measured"]}
    # 8 steps of 2 micro-batches (forwards counted from each rank's first step on): rank 1 skipped one step and
    # entered one more forward, where it waited for rank 0
    assert measured == {
        "optimizer_steps_rank_0": 8,
        "forwards_rank_0": 14,
        "optimizer_steps_rank_1": 7,
        "forwards_rank_1": 15,
    }, measured


def test_a_loss_reduced_with_max_on_rank_0_and_sum_elsewhere_is_named_at_its_first_step_with_its_line(
    tmp_path: Path,
) -> None:
    run = _check(tmp_path, "log-op-rank0")
    assert run.rc == 1 and run.codes == {"collective-mismatch"}, run.output
    f = run.finding("collective-mismatch")
    # The logging all_reduce follows the optimizer step: the first is in the second observed step's window.
    assert (f["severity"], f["ranks"], f["steps"], f.get("more_ranks", 0)) == ("error", [0, 1], [1], 0), f
    line = line_of(SCRIPT, "dist.all_reduce(total, op=")
    assert {site.rsplit("/", 1)[-1] for site in f["sites"]} == {f"fsdp2_train.py:{line}"}, f
    # as many on each rank, compared in order: the script's 7 (after steps 0-6) and FSDP2's of the 8 steps
    assert run.report["compared"]["collectives"] == 7 + 8 * FSDP2_CALLS_PER_STEP


def test_the_same_logging_all_reduce_on_every_rank_is_clean_and_its_collectives_counted(tmp_path: Path) -> None:
    run = _check(tmp_path, "log-every")
    assert run.rc == 0 and run.codes == set(), run.output
    # one all_reduce after the third step, counted in the fourth step's window, on both ranks, and FSDP2's own
    assert (run.report["compared"]["collectives"], run.report["compared"]["state_steps"]) == (
        1 + 8 * FSDP2_CALLS_PER_STEP,
        8,
    )


def test_a_logging_all_reduce_in_float64_on_rank_0_alone_names_the_collective_the_ranks_parted_at(
    tmp_path: Path,
) -> None:
    run = _check(tmp_path, "log-dtype-rank0")
    assert run.rc == 1 and "collective-mismatch" in run.codes, run.output
    f = run.finding("collective-mismatch")
    assert set(f["ranks"]) == {0, 1}, f
    line = line_of(SCRIPT, "dist.all_reduce(total, op=")
    assert f"fsdp2_train.py:{line}" in {site.rsplit("/", 1)[-1] for site in f["sites"]}, f


@pytest.mark.parametrize("synced", [False, True])
def test_a_prompt_tuned_beside_a_frozen_sharded_model_is_no_stale_optimizer(tmp_path: Path, synced: bool) -> None:
    run = _check(tmp_path, "frozen-model,temperature" + ("-synced" if synced else ""))
    assert "optimizer-params-replaced" not in run.codes, run.output
    if synced:
        assert run.rc == 0 and run.errors() == [], run.output
        assert run.report["compared"]["outside_model"] == 1
    else:  # each rank trains its own temperature: that is the error, and the only one
        assert run.errors() == ["unsharded-params-not-synced"], run.output
        assert run.params("unsharded-params-not-synced") == {"temp"}


def test_a_temperature_the_optimizer_trains_beside_the_model_is_named_and_a_synced_one_is_compared_clean(
    tmp_path: Path,
) -> None:
    run = _check(tmp_path / "apart", "temperature")
    found = run.finding("unsharded-params-not-synced")
    assert found["severity"] == "error" and run.params("unsharded-params-not-synced") == {"temp"}
    assert run.report["compared"]["outside_model"] == 1 and run.report["compared"]["outside_groups"] == 0
    own = _check(tmp_path / "own", "temperature-own-opt")
    assert own.params("unsharded-params-not-synced") == {"temp"}, own.output
    synced = _check(tmp_path / "synced", "temperature-synced")
    assert synced.rc == 0 and synced.errors() == [], synced.output
    assert "unsharded-params-not-synced" not in synced.codes and synced.report["compared"]["outside_model"] == 1
