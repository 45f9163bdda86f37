"""A loss reduced across ranks with an in-place dist.all_reduce before its backward (tests/scripts/loss_all_reduce.py,
2 ranks, 4 SGD steps; fsdp2_train.py --mistake loss-avg-inplace under FSDP2).

Ground truth under plain torchrun (torch 2.13.0, gloo; every case exit code 0): avg-inplace (`dist.all_reduce(loss)`,
`loss = loss / world_size`, `loss.backward()`) prints torch's UserWarning "c10d::allreduce_: an autograd kernel was
not registered ... This may lead to silently incorrect behavior" and trains with gradients half of the fix's: the
first weight's gradient at step 0 is -0.0798 against -0.1597 for detached (a detached copy reduced for logging), and
the weights end apart (sum -0.1182 against -0.0879). quarter-inplace (`loss * 0.25` after the SUM): the same
gradient scaled by 0.25. sum-inplace (backward on the sum itself) and after (the reduction after the backward)
compute the fix's gradients. With AMP's GradScaler (`scaler.scale(loss).backward()`, amp-avg-inplace against
amp-detached) the same halving, -0.0798 against -0.1597 after `unscale_`. activation (the output all-reduced before the loss, a tensor) is out of scope: tensor
parallelism's row-parallel layer reduces its output so, and its gradient rightly passes through. Under FSDP2 (Adam) the heads end at -1.061453 against -1.061475. Before, the check
reported each of them clean.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkrun import REPO, SCRIPTS, check, line_of
from frameworkrun import torchrun

SCRIPT = str(SCRIPTS / "loss_all_reduce.py")


def _check(tmp_path: Path, case: str):
    return check(["--nproc-per-node", "2", SCRIPT, str(tmp_path / "out"), "--case", case], tmp_path)


def _grad(tmp_path: Path, case: str) -> float:
    out = tmp_path / case
    done = torchrun("loss_all_reduce.py", [str(out), "--case", case], REPO, timeout=120)
    assert done.rc == 0 or done.aborted_at_exit, done.output[-3000:]
    return json.loads((out / "rank0.json").read_text())["grad"]


def _measured(found: dict) -> dict[str, float]:
    return {m["name"]: m["value"] for m in found["measured"]}


@pytest.mark.parametrize("amp", ["", "amp-"])
def test_a_loss_averaged_in_place_before_backward_halves_every_gradient_and_is_named_at_its_line(
    tmp_path: Path, amp: str
) -> None:
    halved, fixed = _grad(tmp_path, f"{amp}avg-inplace"), _grad(tmp_path, f"{amp}detached")
    assert halved == pytest.approx(fixed / 2, rel=1e-5), (halved, fixed)
    run = _check(tmp_path / "check", f"{amp}avg-inplace")
    found = run.finding("collective-in-graph")
    assert found["severity"] == "warning" and found["ranks"] == [0] and found["steps"] == [0], found
    where = line_of(SCRIPT, '("avg-inplace", "amp-avg-inplace")') + 1
    at = f"loss_all_reduce.py:{where}"
    assert any(site.endswith(at) for site in found["sites"]), (found["sites"], at)
    measured = _measured(found)
    assert measured["gradient_factor"] == pytest.approx(0.5, rel=1e-6) and measured["group_size"] == 2, measured
    # AMP's GradScaler multiplies the gradient by its loss scale (65536 at the start), which it divides out later
    assert measured.get("loss_scale") == (65536.0 if amp else None), measured
    assert "detach()" in found["fix"], found


def test_another_factor_after_the_sum_is_an_info_with_the_factor(tmp_path: Path) -> None:
    run = _check(tmp_path, "quarter-inplace")
    found = run.finding("collective-in-graph")
    assert found["severity"] == "info" and _measured(found)["gradient_factor"] == pytest.approx(0.25, rel=1e-6)
    where = line_of(SCRIPT, '"quarter-inplace":') + 1
    at = f"loss_all_reduce.py:{where}"
    assert any(site.endswith(at) for site in found["sites"]), found["sites"]


@pytest.mark.parametrize("case", ["sum-inplace", "after", "detached", "amp-detached", "activation"])
def test_a_reduction_that_changes_no_gradient_is_not_reported(tmp_path: Path, case: str) -> None:
    run = _check(tmp_path, case)
    assert "collective-in-graph" not in run.codes, run.output
    assert run.rc == 0


def test_the_same_under_fsdp2_is_named_with_fsdp2_averaging(tmp_path: Path) -> None:
    script = str(SCRIPTS / "fsdp2_train.py")
    args = ["--nproc-per-node", "2", "--no-verify", script, "--mistake", "loss-avg-inplace", "--steps", "4"]
    run = check(args, tmp_path, timeout=180)
    found = run.finding("collective-in-graph")
    assert found["severity"] == "warning" and _measured(found)["gradient_factor"] == pytest.approx(0.5, rel=1e-6)
    at = f"fsdp2_train.py:{line_of(script, 'dist.all_reduce(loss)')}"
    assert any(site.endswith(at) for site in found["sites"]), found["sites"]
    assert run.report["parallelism"] == "fsdp2"
