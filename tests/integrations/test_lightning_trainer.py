"""Lightning + DoctorCallback, end to end: `Trainer(accelerator="cpu", devices=2, strategy=...)` launched by torchrun
(Lightning detects torchelastic's environment), with Lightning's own BackboneFinetuning unfreezing the backbone and a
user callback freezing the neck at epoch 1 (layers frozen after DDP was built; Lightning issue 20340)."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check
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
