"""`ddp-doctor check` on real-script patterns outside the seeds: the same findings as the in-process matrix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkrun import EXAMPLES, SCRIPTS, check


def test_a_gan_s_critic_failure_is_reported_against_the_critic_only(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "gan.py")], tmp_path, timeout=180)
    assert run.rc == 1, run.output
    generator, critic = run.report, run.report["other_models"][0]
    assert generator["model"] == "Sequential" and critic["model"] == "Critic"
    assert generator["findings"] == [], generator["findings"]  # nothing of the critic's crash leaks here
    reduction = next(f for f in critic["findings"] if f["code"] == "reduction-error")
    assert {p["name"] for p in reduction["params"]} == {"aux.weight", "aux.bias"}


def test_reentrant_checkpoint_without_grad_input_is_grad_blocked_never_freeze(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "checkpoint_input.py")], tmp_path, timeout=180)
    assert run.rc == 1, run.output
    assert {"grad-blocked", "reentrant-checkpoint"} <= run.codes, run.output
    assert run.params("grad-blocked") == {"stem.0.weight", "stem.0.bias"}
    site = run.finding("reentrant-checkpoint")
    assert "checkpoint_input.py:23" in site["title"] and "use_reentrant=False" in site["fix"], site
    assert run.report["recommendation"]["freeze_before_wrap"] == []
    fixed = check(
        ["--nproc-per-node", "2", str(SCRIPTS / "checkpoint_input.py"), "--fixed"], tmp_path / "fixed", timeout=180
    )
    assert fixed.rc == 0 and not fixed.errors(), fixed.output


def test_a_model_trained_on_every_rank_without_ddp_is_model_not_wrapped(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "no_ddp.py")], tmp_path, timeout=180)
    assert run.rc == 1, run.output
    assert run.codes == {"model-not-wrapped"}, run.output
    finding = run.finding("model-not-wrapped")
    assert finding["severity"] == "error" and "SGD created at tests/scripts/_train.py:21" in finding["detail"]
    assert run.params("model-not-wrapped") == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert run.report["steps_observed"] == 3  # the script ends after 3 steps, before K


def test_a_correct_manual_sync_without_ddp_is_info_only(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "manual_sync.py")], tmp_path, timeout=180)
    assert run.rc == 0, run.output
    finding = run.finding("model-not-wrapped")
    assert finding["severity"] == "info" and "sync_gradients" in finding["fix"], finding
    assert run.report["steps_observed"] == 8


def test_a_tensor_parallel_model_is_no_unwrapped_model_and_says_what_was_not_compared(tmp_path: Path) -> None:
    """tests/scripts/tensor_parallel.py, plain torchrun, torch 2.13.0, gloo, 2 ranks: exit code 0, the head's bias
    sums 0.024975 on both ranks. Before, the check compared none of its parameters (all DTensors) and said "No
    problems found." with the advice to wrap the model in DDP, then "No problems found in what was checked" above a
    note that nothing was compared."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "tensor_parallel.py")], tmp_path, timeout=180)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    assert run.report["compared"] == {"parallelism": "none", "ranks": 2, "steps": 8, "parameters": 0, "dtensors": 4}
    assert "No problems found" not in run.output
    (unchecked,) = run.report["unchecked"]
    assert "4 of the parameters the optimizer (SGD created at tests/scripts/tensor_parallel.py:18)" in unchecked
    assert "none of them was compared; it steps no other" in unchecked
    reason = run.report["recommendation"]["reason"]
    assert "wrapping this model in DDP is not the advice" in reason and "wrap the model first" not in reason


def test_ranks_with_different_batch_counts_are_uneven_inputs(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(EXAMPLES / "uneven_inputs.py")], tmp_path, timeout=180)
    assert run.rc == 1, run.output
    finding = run.finding("uneven-inputs")
    assert finding["severity"] == "error" and "rank 0: 13, rank 1: 12" in finding["title"], finding
    assert "Rank 1 runs out after 12 batches" in finding["detail"] and "Join" in finding["fix"]


def test_a_sampler_whose_epoch_is_never_set_is_named_and_set_epoch_is_clean(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "sampler_epoch.py")], tmp_path, timeout=180)
    assert run.rc == 0, run.output  # a warning: below the default --fail-on error
    finding = run.finding("sampler-epoch-not-set")
    assert finding["severity"] == "warning", finding
    assert {m["name"]: m["value"] for m in finding["measured"]}["epoch"] == 0, finding
    fixed = check(
        ["--nproc-per-node", "2", str(SCRIPTS / "sampler_epoch.py"), "--set-epoch"], tmp_path / "fixed", timeout=180
    )
    assert "sampler-epoch-not-set" not in fixed.codes and "uneven-inputs" not in fixed.codes, fixed.output


TIMING = {"straggler-rank", "input-bound"}
"""Measurements of this machine, not of the script: 4 ranks on 2 cores make one rank slower in most steps."""


def _groups(run) -> list[tuple[list[int], set[str]]]:
    """Each group's ranks and its findings' codes, the timing measurements left out."""
    models = [run.report, *run.report.get("other_models", [])]
    return [(m["ddp_config"]["process_group_ranks"], {f["code"] for f in m["findings"]} - TIMING) for m in models]


def test_ddp_over_subgroups_is_compared_within_each_group(tmp_path: Path) -> None:
    # Two data-parallel groups holding different models: no "different models" error, one report per group.
    run = check(["--nproc-per-node", "4", str(SCRIPTS / "subgroups.py")], tmp_path, timeout=240)
    assert run.rc == 0, run.output
    assert _groups(run) == [([0, 1], set()), ([2, 3], set())], run.output
    # The same architecture with different weights per group: no false grads-not-synced or replica-divergence.
    same = check(
        ["--nproc-per-node", "4", str(SCRIPTS / "subgroups.py"), "--same-arch"], tmp_path / "same", timeout=240
    )
    assert same.rc == 0 and _groups(same) == [([0, 1], set()), ([2, 3], set())], same.output
    # A finding in the second group names that group's global ranks.
    unused = check(
        ["--nproc-per-node", "4", str(SCRIPTS / "subgroups.py"), "--unused-head"], tmp_path / "unused", timeout=240
    )
    assert _groups(unused) == [([0, 1], set()), ([2, 3], {"unused-parameters"})], unused.output
    finding = next(f for f in unused.report["other_models"][0]["findings"] if f["code"] == "unused-parameters")
    assert finding["ranks"] == [2, 3] and {p["name"] for p in finding["params"]} == {"head.weight", "head.bias"}


@pytest.mark.parametrize("placement", [[], ["--outside"]], ids=["compile-inside-ddp", "compile-around-ddp"])
def test_torch_compile_either_side_of_ddp_shows_user_names_and_the_fix_applies(
    tmp_path: Path, placement: list[str]
) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "compiled.py"), *placement], tmp_path, timeout=240)
    assert run.codes == {"unused-parameters"}, run.output
    assert run.params("unused-parameters") == {"aux.weight", "aux.bias"}  # no `_orig_mod.` prefix
    assert "_orig_mod" not in json.dumps(run.report) and "global hooks" not in run.output
    rec = run.report["recommendation"]
    assert rec["freeze_before_wrap"] == ["aux.weight", "aux.bias"]
    kwargs = json.dumps(
        {
            "freeze_before_wrap": rec["freeze_before_wrap"],
            "find_unused_parameters": rec["find_unused_parameters"],
            "static_graph": rec["static_graph"],
        }
    )
    applied = check(
        ["--nproc-per-node", "2", "--ddp-kwargs", kwargs, str(SCRIPTS / "compiled.py"), *placement],
        tmp_path / "applied",
        timeout=240,
    )
    assert applied.rc == 0 and applied.codes == set(), applied.output
    assert applied.report["recommendation"]["verified"] is True, applied.report["recommendation"]
