"""Lightning + DoctorCallback, end to end: `Trainer(accelerator="cpu", devices=2, strategy=...)` launched by torchrun
(Lightning detects torchelastic's environment), with Lightning's own BackboneFinetuning unfreezing the backbone and a
user callback freezing the neck at epoch 1 (layers frozen after DDP was built; Lightning issue 20340)."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, Run, check
from frameworkrun import codes, finding, load, params, same_findings, torchrun

pytestmark = pytest.mark.timeout(300)

BACKBONE = {"backbone.weight", "backbone.bias"}
NECK = {"neck.weight", "neck.bias"}


def test_frozen_set_changed_mid_training_is_flagged_and_stops_the_run(tmp_path: Path) -> None:
    run = torchrun("lightning_finetune.py", [str(tmp_path / "root")], tmp_path)
    report = load(tmp_path / "root" / "ddp_doctor.json", run)
    assert report["framework"] == "lightning" and report["steps_observed"] == 6
    assert report["ddp_config"]["find_unused_parameters"] is True  # strategy="ddp_find_unused_parameters_true"
    assert codes(report) == {"unfrozen-after-wrap", "frozen-after-wrap", "grads-not-synced", "replica-divergence"}
    assert params(report, "unfrozen-after-wrap") == BACKBONE
    assert params(report, "frozen-after-wrap") == NECK
    assert params(report, "grads-not-synced") == BACKBONE  # never all-reduced: each rank trains its own backbone
    assert finding(report, "unfrozen-after-wrap")["steps"] == [2, 3, 4, 5]
    assert "before trainer.fit() builds DDP" in finding(report, "unfrozen-after-wrap")["fix"]
    assert 'Trainer(strategy="ddp_find_unused_parameters_true")' in finding(report, "frozen-after-wrap")["fix"]
    assert "DDPStrategy(find_unused_parameters=True" in report["recommendation"]["render"]["lightning"]
    # fail_on="error" (the default): after the report, every rank stops with FindingsError.
    assert run.rc != 0, run.output[-6000:]
    assert (
        run.output.count("stopped by ddp-doctor: ['grads-not-synced', 'replica-divergence', 'unfrozen-after-wrap']")
        == 2
    ), run.output[-6000:]
    assert run.output.count("ddp-doctor report after 6 observed steps") == 1

    checked = check(
        ["--nproc-per-node", "2", "--steps", "6", str(SCRIPTS / "lightning_finetune.py"), str(tmp_path / "c")],
        tmp_path / "check",
    )
    assert checked.rc == 1 and checked.report is not None, checked.output
    same_findings(report, checked.report)
    assert "stopped by ddp-doctor" not in checked.output  # the callback stood by


def test_ddp_crash_after_freezing_is_explained_by_the_callback(tmp_path: Path) -> None:
    # strategy="ddp" (find_unused_parameters=False): the neck frozen at epoch 1 never gets a gradient, so DDP fails at
    # the next step. Lightning hands the exception to the callback, which reports with the other rank and re-raises.
    run = torchrun("lightning_finetune.py", [str(tmp_path / "root"), "--strategy", "ddp"], tmp_path)
    assert run.rc != 0
    assert "Expected to have finished reduction" in run.output
    report = load(tmp_path / "root" / "ddp_doctor.json", run)
    assert report["ddp_config"]["find_unused_parameters"] is False
    assert {"reduction-error", "frozen-after-wrap", "unfrozen-after-wrap"} <= codes(report), codes(report)
    assert params(report, "reduction-error") == NECK
    assert finding(report, "reduction-error")["steps"] == [3]
    assert sorted(c["rank"] for c in report["crashes"]) == [0, 1]
    assert report["recommendation"]["find_unused_parameters"] is True


GENERATOR = {"generator.0.weight", "generator.0.bias", "generator.2.weight", "generator.2.bias"}
GAN = "tests/scripts/lightning_gan.py"


def test_a_gan_s_two_manual_backward_passes_are_explained_and_find_unused_is_advised(tmp_path: Path) -> None:
    """A GAN with manual optimization: `training_step` (inside DDP's forward) runs `manual_backward(d_loss)`, steps
    the discriminator, then `manual_backward(g_loss)` and steps the generator (tests/scripts/lightning_gan.py).

    Measured with plain torchrun (torch 2.13.0+cpu, lightning 2.6.6, gloo, 2 ranks): strategy="ddp" fails in step 0's
    second manual_backward (Lightning's prepare_for_backward), with DDP's reduction error reworded by Lightning ("It
    looks like your LightningModule has parameters that were not used in producing the loss"); static_graph=True
    fails with "Your training graph has changed"; strategy="ddp_find_unused_parameters_true" runs, the replicas
    identical after every step (Lightning prepares DDP's reduction from each manual_backward's loss). The check used
    to call the generator grad-blocked and advise static_graph=True.
    """
    run = check(
        ["--nproc-per-node", "2", str(SCRIPTS / "lightning_gan.py"), str(tmp_path / "root")], tmp_path, timeout=240
    )
    assert run.rc == 1 and run.report is not None, run.output
    assert run.report["framework"] == "lightning"
    assert run.codes == {"reduction-error"}, run.output  # no grad-blocked: the generator trains in the second pass
    f = run.finding("reduction-error")
    assert f["ranks"] == [0, 1] and f["steps"] == [0], f
    assert run.params("reduction-error") == GENERATOR
    assert "second backward pass through one forward" in f["title"], f
    assert f"{GAN}:32" in f["detail"] and f"{GAN}:36" in f["detail"], f["detail"]  # each manual_backward
    assert 'Trainer(strategy="ddp_find_unused_parameters_true")' in f["fix"], f
    rec = run.report["recommendation"]
    assert rec["find_unused_parameters"] is True and rec["static_graph"] is False, rec
    # check's own second run applied it (the observed steps ended early, in the crash) and got past step 0.
    assert rec["verified"] is True and rec["verification"]["outcome"] == "verified", rec
    assert 'strategy="ddp_find_unused_parameters_true"' in rec["render"]["lightning"], rec["render"]

    # The recommendation applied (--ddp-kwargs): every step synced, nothing at warning or error, verified.
    fixed = check(
        [
            "--nproc-per-node",
            "2",
            "--ddp-kwargs",
            '{"find_unused_parameters": true}',
            str(SCRIPTS / "lightning_gan.py"),
            str(tmp_path / "fixed"),
        ],
        tmp_path / "check-fixed",
        timeout=240,
    )
    assert fixed.rc == 0 and fixed.report is not None, fixed.output
    _assert_clean_gan(fixed)
    assert fixed.report["recommendation"]["verified"] is True, fixed.report["recommendation"]


def test_a_gan_already_on_ddp_find_unused_parameters_true_is_clean(tmp_path: Path) -> None:
    run = check(
        [
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "lightning_gan.py"),
            str(tmp_path / "root"),
            "--strategy",
            "ddp_find_unused_parameters_true",
        ],
        tmp_path,
        timeout=240,
    )
    assert run.rc == 0 and run.report is not None, run.output
    assert run.report["ddp_config"]["find_unused_parameters"] is True
    _assert_clean_gan(run)
    assert run.report["recommendation"]["verified"] is True


def _assert_clean_gan(run: Run) -> None:
    timing = {"input-bound", "straggler-rank"}  # measurements on this shared machine, not about DDP's flags
    shown = [f["code"] for f in run.report["findings"] if f["severity"] != "info" and f["code"] not in timing]
    assert shown == [], run.output  # no find-unused-unneeded: each pass leaves the other network's parameters out
    passes = run.finding("backward-passes-differ")
    assert passes["severity"] == "info" and passes["ranks"] == [0, 1], passes
    assert passes["steps"] == list(range(run.report["steps_observed"])) and run.report["steps_observed"] == 6
    assert passes["sites"] == [f"{GAN}:32", f"{GAN}:36"], passes
    assert passes["labels"] == {"kind": "manual-backward", "outcome": "handled"}, passes
    assert run.params("backward-passes-differ") == GENERATOR  # the discriminator's pass leaves them out
    rec = run.report["recommendation"]
    assert rec["find_unused_parameters"] is True and rec["static_graph"] is False, rec


def test_a_collective_a_callback_issues_on_rank_0_only_is_named_first_with_each_ranks_line(tmp_path: Path) -> None:
    """tests/scripts/lightning_rank0_collective.py under plain torchrun (group timeout 15 s there): exit code 1 after
    the timeout; rank 0 fails in the callback's `dist.all_reduce` ("Timed out waiting 15000ms for recv"), rank 1 in
    `trainer.fit` ("Application timeout caused pair closure"), the first epoch's end. The check observes its 8
    steps clean and meets it at the epoch end it follows: the first finding is the mismatch, naming rank 0's
    all_reduce at the callback's line and what rank 1 called at the same position (Lightning's broadcast inside
    `trainer.fit`); rank 1's lost connection follows from it."""
    script = SCRIPTS / "lightning_rank0_collective.py"
    run = check(["--nproc-per-node", "2", str(script), str(tmp_path / "root")], tmp_path, timeout=240)
    assert run.rc == 1, run.output
    first = run.report["findings"][0]
    lines = script.read_text().splitlines()
    reduce_line = next(i for i, line in enumerate(lines, 1) if "dist.all_reduce(total)" in line)
    assert first["code"] == "collective-mismatch" and first["ranks"] == [0, 1], first
    assert f"all_reduce(float32[1]) at tests/scripts/lightning_rank0_collective.py:{reduce_line}" in first["detail"]
    crashed = [f for f in run.report["findings"] if f["code"] == "rank-crashed"]
    assert all(f.get("caused_by") == ["collective-mismatch"] for f in crashed), crashed
