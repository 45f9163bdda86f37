"""Whether an FSDP2 job trains at all, by DDP's rule (`analyze/moves.stalled`): every gradient exactly zero at every
measured step (whatever weight decay does to the weights), or no weight moved (a learning rate of 0).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (tests/scripts/fsdp2_train.py):
`--mistake lr-zero` leaves every weight where it was (largest change 0, head.weight -0.703294 on both ranks), exit 0;
`--mistake zero-loss` (the loss multiplied by 0) gives zero gradients and only AdamW's weight decay moves the
weights (largest change 0.0003), exit 0; `--mistake nan-loss` (the loss NaN from the fourth step) ends with every
weight NaN (head.weight sums nan on both ranks), exit 0. The clean job moves every weight (largest change 0.109).

Some parameters only: `--mistake head-not-stepped` (the optimizer built over every parameter but the head's) and
`--mistake head-lr-zero` (the head in a param group at lr 0) each end with head.weight unchanged (largest change
of the head 0, of the rest 0.113), exit 0, nothing said; `--mistake head-second-opt` (the head stepped by an SGD of
its own) moves the head by 0.0466, and is clean.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check


@pytest.mark.parametrize("mistake, zero", [("lr-zero", False), ("zero-loss", True)])
def test_a_sharded_job_that_does_not_train_is_training_stalled(tmp_path: Path, mistake: str, zero: bool) -> None:
    args = ["--nproc-per-node", "2", "--no-verify", str(SCRIPTS / "fsdp2_train.py"), "--mistake", mistake]
    run = check(args, tmp_path, timeout=240)
    assert run.rc == 1 and run.codes == {"training-stalled"}, run.output
    f = run.finding("training-stalled")
    assert f["ranks"] == [0, 1] and len(f["steps"]) >= 7, f
    # the cause, measured: every gradient zero at every step (weight decay moved the weights), or a rate of 0
    measured = {m["name"]: m["value"] for m in f["measured"]}
    assert measured["steps_with_all_gradients_zero"] == (len(f["steps"]) if zero else 0), measured
    assert (measured["largest_learning_rate"] == 0) is not zero, measured


def test_nan_in_the_gradient_shards_is_named_with_its_first_step(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "2", "--no-verify", str(SCRIPTS / "fsdp2_train.py"), "--mistake", "nan-loss"]
    run = check(args, tmp_path, timeout=240)
    assert run.rc == 1 and "non-finite-values" in run.codes and "training-stalled" not in run.codes, run.output
    f = run.finding("non-finite-values")
    assert f["steps"][0] == 3 and f["ranks"] == [0, 1], f
    assert not any(m["name"].endswith("nonfinite_inputs") for m in f["measured"]), f  # every input was finite


def test_nan_in_one_ranks_batch_is_named_with_that_rank(tmp_path: Path) -> None:
    """`--mistake nan-rank1` (one NaN in rank 1's batch at step 2, of 4 ranks; plain torchrun: exit 0, every weight
    NaN on every rank at the end, head.weight sum nan): FSDP2's reduce-scatter spreads it to every rank's gradient
    shards. Before, the report named the step and not the rank whose data held it."""
    args = ["--nproc-per-node", "4", "--no-verify", str(SCRIPTS / "fsdp2_train.py"), "--mistake", "nan-rank1"]
    run = check([*args, "--steps", "6"], tmp_path, timeout=240)
    f = run.finding("non-finite-values")
    assert f["steps"][0] == 2 and f["ranks"] == [0, 1, 2, 3], f
    measured = {m["name"]: m["value"] for m in f["measured"]}
    assert measured == {"first_rank_with_nonfinite_inputs": 1, "step_of_nonfinite_inputs": 2}, measured
    assert "rank 1" in f["fix"], f


@pytest.mark.parametrize(
    "mistake, held, zero_lr", [("head-not-stepped", 0, 0), ("head-lr-zero", 2, 2), ("head-second-opt", None, None)]
)
def test_parameters_with_gradients_that_never_change_are_named_with_their_cause(
    tmp_path: Path, mistake: str, held: int | None, zero_lr: int | None
) -> None:
    args = ["--nproc-per-node", "2", "--no-verify", str(SCRIPTS / "fsdp2_train.py"), "--mistake", mistake]
    run = check(args, tmp_path, timeout=240)
    if held is None:  # another optimizer trains the head: clean
        assert run.rc == 0 and run.codes == set(), run.output
        return
    assert run.rc == 0 and run.codes == {"training-stalled"}, run.output
    f = run.finding("training-stalled")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1], f
    assert sorted(p["name"] for p in f["params"]) == ["head.bias", "head.weight"], f
    # the cause, from what the optimizer holds: not these parameters, or these at a learning rate of 0
    assert {m["name"]: m["value"] for m in f["measured"]} == {
        "parameters_never_updated": 2,
        "held_by_the_optimizer": held,
        "held_at_learning_rate_0": zero_lr,
    }, f
