"""`ddp-doctor check` compares the gradients where `optimizer.step()` uses them, not only where DDP's all-reduce
left them. Each script was run under plain torchrun first (2 ranks, gloo, torch 2.13 CPU, 10 steps); what happened
is in each test's docstring."""

from __future__ import annotations

import pytest
from checkrun import SCRIPTS, check, line_of

TIMING = {"input-bound", "straggler-rank"}
"""Measurements of where the step time goes on this machine, which other jobs share: not about the gradients."""


def _loud(run) -> set[str]:
    return {f["code"] for f in run.report["findings"] if f["severity"] in ("error", "warning")} - TIMING


def test_clip_on_rank0_only_is_grads_changed_after_sync(tmp_path) -> None:
    """grads_clip_rank0.py: `clip_grad_norm_(params, 0.5)` under `if rank == 0:` after loss.backward(). Plain
    torchrun: exit 0, no warning; rank 0 printed grad norms 11.8 to 29.7 (so it clipped every step), and after 10
    steps the sum of squared weights was 6.67 on rank 0 and 29.20 on rank 1. Before this check existed, the report
    said "the cause is unknown. The gradients agreed at every optimizer step"."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "grads_clip_rank0.py")], tmp_path)
    assert run.rc == 1, run.output
    f = run.finding("grads-changed-after-sync")
    assert f["severity"] == "error" and f["ranks"] == [0], f
    assert f["steps"] == list(range(8)), f
    assert run.params("grads-changed-after-sync") == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert f["sites"] == ["tests/scripts/grads_clip_rank0.py:24"], f
    labels = {"kind": "call", "call": "clip_grad_norm_(max_norm=0.5)", "compared_at": "step-begin"}
    assert f["labels"] == labels, f
    assert "tests/scripts/grads_clip_rank0.py:24" in f["fix"], f  # the fix names the line to move
    assert _loud(run) == {"grads-changed-after-sync", "replica-divergence"}, run.output
    assert run.finding("replica-divergence")["caused_by"] == ["grads-changed-after-sync"]
    assert "the gradients agreed" not in run.output.lower().replace("\n", " ")


def test_grad_doubled_on_rank1_only_is_grads_changed_after_sync(tmp_path) -> None:
    """grads_scaled_rank1.py: rank 1 runs `p.grad.mul_(2)` on the last layer's parameters after loss.backward().
    Plain torchrun: exit 0, no warning; after 10 steps the sum of squared weights was 6.809 on rank 0 and 6.850 on
    rank 1 (the plain sum of the weights stays equal: softmax gradients of a 2-class head sum to zero)."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "grads_scaled_rank1.py")], tmp_path)
    assert run.rc == 1, run.output
    f = run.finding("grads-changed-after-sync")
    assert f["ranks"] == [1] and f["steps"] == list(range(8)), f
    assert run.params("grads-changed-after-sync") == {"2.weight", "2.bias"}
    assert f["labels"] == {"kind": "grad-write", "compared_at": "step-begin"} and f["sites"] == [], f
    assert "grads-not-synced" not in run.codes, run.output
    assert _loud(run) == {"grads-changed-after-sync", "replica-divergence"}, run.output


@pytest.mark.parametrize(
    "script, how, line",
    [
        ("nosync_every_micro.py", "no_sync", "tests/scripts/nosync_every_micro.py:24"),
        ("sync_flag_off.py", "require_backward_grad_sync", "tests/scripts/sync_flag_off.py:20"),
    ],
)
def test_sync_off_for_every_micro_batch_names_it(tmp_path, script: str, how: str, line: str) -> None:
    """nosync_every_micro.py: 2 micro-batches per step, both forward+backward inside `with ddp.no_sync():`.
    sync_flag_off.py: `ddp.require_backward_grad_sync = False` once before the loop. Plain torchrun, both: exit 0,
    no warning, DDP never reduced; after 10 steps the sum of squared weights was 6.783 on rank 0 and 6.767 on
    rank 1."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / script)], tmp_path)
    assert run.rc == 1, run.output
    f = run.finding("grads-not-synced")
    assert f["ranks"] == [0, 1] and f["steps"] == list(range(8)), f
    assert run.params("grads-not-synced") == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert f["labels"] == {"kind": "sync-off", "how": how} and f["sites"] == [line] and line in f["fix"], f
    assert "grads-changed-after-sync" not in run.codes
    assert _loud(run) == {"grads-not-synced", "replica-divergence"}, run.output


@pytest.mark.parametrize("script", ["grads_clip_every_rank.py", "nosync_but_last.py", "sync_flag_nanogpt.py"])
def test_legitimate_neighbours_stay_clean(tmp_path, script: str) -> None:
    """grads_clip_every_rank.py (clip_grad_norm_ on every rank), nosync_but_last.py (3 micro-batches, no_sync() on
    the first two) and sync_flag_nanogpt.py (`require_backward_grad_sync = (micro_step == 2)`). Plain torchrun: exit
    0, identical replicas after 10 steps (sums of squared weights 6.650963 / 6.650963, 6.710896 / 6.710896 and
    6.710896 / 6.710896 on ranks 0 / 1)."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / script)], tmp_path)
    assert _loud(run) == set(), run.output
    assert run.rc == 0 or {f["code"] for f in run.report["findings"] if f["severity"] == "error"} <= TIMING


def test_a_comm_hook_that_never_all_reduces_is_named_and_its_fix_applied_is_clean(tmp_path) -> None:
    """comm_hook.py: `register_comm_hook(None, local_only)`, a hook that returns each bucket as it is (a compression
    hook whose all-reduce was left out). Plain torchrun: exit 0, no warning; after 10 steps the weights are 0.0696
    apart across the ranks. With the fix the report gives (the hook all-reduces the bucket divided by the world
    size, `--hook fixed`) and with torch's fp16_compress_hook: 0.0 apart. Before, the report's fix spoke of
    backward passes through `.module` and edits of `.grad`, none of which the script does."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "comm_hook.py"), "--hook", "local"], tmp_path / "local")
    f = run.finding("grads-not-synced")
    assert f["ranks"] == [0, 1] and f["steps"] == list(range(8)), f
    assert f["sites"] == [f"tests/scripts/comm_hook.py:{line_of(SCRIPTS / 'comm_hook.py', 'def local_only(')}"], f
    assert _loud(run) == {"grads-not-synced", "replica-divergence"} and run.rc == 1, run.output
    fixed = check(["--nproc-per-node", "2", str(SCRIPTS / "comm_hook.py"), "--hook", "fixed"], tmp_path / "fixed")
    assert _loud(fixed) == set() and fixed.report["compared"]["collectives"] == 8, fixed.output
