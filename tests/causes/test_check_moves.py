"""Whether training moves at all (tests/scripts/moves.py, 2 ranks, 5 SGD steps).

Ground truth under plain torchrun (torch 2.13.0, gloo; each case exit code 0, nothing printed but the losses):
- meta: the model built on the meta device and materialised with `to_empty()`, never initialised: its weights are
  whatever the memory held; the loss at step 0 was NaN in 2 runs of 3 and 2.2e16 in the third (not a case a test
  can assert on; the rule that names `to_empty()` is tested on hand-built records).
- log-softmax: the loss written as `-log(softmax(logits * 1000))`: the softmax underflows to 0, the loss is inf at
  step 0 and NaN from step 1, every gradient NaN from step 0.
- one-column: cross_entropy over a model with one output column: the loss is exactly 0 at every step, every gradient
  is exactly zero, and no weight changes (largest change 0).
- nan-rank1: rank 1's batch holds one NaN at step 2 (a corrupt sample): rank 0's own loss at step 2 is finite
  (1.40), DDP's all-reduce carries rank 1's NaN gradients to both ranks, every weight is NaN on both ranks at the
  end and every loss NaN from step 3.
- dead-output: the head's output through a ReLU whose bias starts at -100: every output is 0, the loss is 1.386 (log
  4) at every step, every gradient exactly zero, no weight changes.
- lr0: SGD with lr=0: the losses vary (1.50, 1.36, 1.41, ...) and the gradients are nonzero, but no weight changes.
- meta-init (the same meta model, then `reset_parameters()`) and warmup (a LambdaLR whose learning rate is 0 at the
  first step only) train normally.
- head-not-stepped (the optimizer built over the first layer only) and head-lr0 (the head in a param group at lr 0):
  the head gets gradients and never changes (largest change 0), the first layer trains; head-second-opt (the head
  stepped by an SGD of its own) moves it by 0.0256 and is clean.
Before, `ddp-doctor check` reported "No problems found" and a verified recommendation for log-softmax, one-column
and lr0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

SCRIPT = str(SCRIPTS / "moves.py")
ALL = {"0.weight", "0.bias", "2.weight", "2.bias"}


def _check(tmp_path: Path, case: str):
    return check(["--nproc-per-node", "2", SCRIPT, "--case", case], tmp_path)


@pytest.mark.parametrize(
    ("case", "step", "fed"),
    [
        ("log-softmax", 0, {}),
        # the rank whose own batch held the NaN, measured before DDP's all-reduce spread it
        ("nan-rank1", 2, {"ranks_with_nonfinite_inputs": 1, "first_rank_with_nonfinite_inputs": 1,
                          "step_of_nonfinite_inputs": 2}),
    ],
)  # fmt: skip
def test_non_finite_values_are_named_at_their_first_step_with_every_parameter(tmp_path, case, step, fed) -> None:
    run = _check(tmp_path, case)
    found = run.finding("non-finite-values")
    assert found["severity"] == "error" and found["steps"] == [step] and found["ranks"] == [0, 1]
    assert {m["name"]: m["value"] for m in found.get("measured", [])} == fed, found
    assert run.params("non-finite-values") == ALL
    assert ("detect_anomaly" in found["fix"]) == (not fed), found["fix"]  # else: find that rank's sample
    assert run.report["recommendation"]["verified"] is False and run.rc == 1


@pytest.mark.parametrize(
    ("case", "cause"), [("one-column", "exactly zero"), ("dead-output", "exactly zero"), ("lr0", "learning rate is 0")]
)
def test_steps_that_change_no_weight_are_training_stalled_with_the_cause(tmp_path: Path, case: str, cause: str) -> None:
    run = _check(tmp_path, case)
    found = run.finding("training-stalled")
    assert found["severity"] == "error" and found["steps"] == [0, 1, 2, 3, 4] and cause in found["title"]
    assert run.codes == {"training-stalled"} and run.rc == 1


@pytest.mark.parametrize("case", ["meta-init", "warmup"])
def test_an_initialised_meta_model_and_a_warm_up_from_0_stay_clean(tmp_path: Path, case: str) -> None:
    run = _check(tmp_path, case)
    assert run.rc == 0 and run.codes == set(), run.output


@pytest.mark.parametrize(("case", "held", "zero_lr"), [("head-not-stepped", 0, 0), ("head-lr0", 2, 2)])
def test_parameters_with_gradients_that_never_change_are_named_with_their_cause(
    tmp_path: Path, case: str, held: int, zero_lr: int
) -> None:
    run = _check(tmp_path, case)
    assert run.rc == 0 and run.codes == {"training-stalled"}, run.output
    f = run.finding("training-stalled")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1], f
    assert run.params("training-stalled") == {"2.weight", "2.bias"}, f
    # the cause, from what the optimizer holds: not the head, or the head at a learning rate of 0
    assert {m["name"]: m["value"] for m in f["measured"]} == {
        "parameters_never_updated": 2,
        "held_by_the_optimizer": held,
        "held_at_learning_rate_0": zero_lr,
    }, f


def test_a_head_trained_by_a_second_optimizer_stays_clean(tmp_path: Path) -> None:
    run = _check(tmp_path, "head-second-opt")
    assert run.rc == 0 and run.codes == set(), run.output
