"""HF Trainer + DoctorCallback, end to end: 2 ranks, CPU, gloo, tiny models built from configs (nothing downloaded).
Each scenario runs the script once under torchrun with the callback, and once under `ddp-doctor check` unmodified;
both must report the same findings."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check
from frameworkrun import OFFLINE, codes, finding, load, params, same_findings, torchrun

pytestmark = pytest.mark.timeout(400)

SCORE_HEAD = {"score_head.weight", "score_head.bias"}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)


def test_bert_trainer_defaults_pay_for_find_unused(tmp_path: Path) -> None:
    run = torchrun("hf_bert.py", [str(tmp_path / "out")], tmp_path)
    assert run.finished, run.output[-6000:]
    report = load(tmp_path / "out" / "ddp_doctor.json", run)
    # Measured on the installed transformers: the Trainer turns find_unused_parameters on for a PreTrainedModel
    # without gradient checkpointing, and every parameter of the BERT classifier reaches the loss.
    assert report["ddp_config"]["find_unused_parameters"] is True
    assert report["framework"] == "transformers" and report["steps_observed"] == 4 and report["world_size"] == 2
    assert codes(report) == {"find-unused-unneeded"}
    assert finding(report, "find-unused-unneeded")["fix"] == "set TrainingArguments(ddp_find_unused_parameters=False)."
    rec = report["recommendation"]
    assert (rec["find_unused_parameters"], rec["static_graph"], rec["freeze_before_wrap"]) == (False, False, [])
    assert "args = TrainingArguments(..., ddp_find_unused_parameters=False)" in rec["render"]["transformers"]
    # The main process logs the report once; training then goes on to max_steps.
    assert run.output.count("ddp-doctor report after 4 observed steps") == 1, run.output[-6000:]
    assert "fix: set TrainingArguments(ddp_find_unused_parameters=False)." in run.output
    assert "'train_runtime'" in run.output

    checked = check(
        ["--nproc-per-node", "2", "--steps", "4", str(SCRIPTS / "hf_bert.py"), str(tmp_path / "c")], tmp_path / "check"
    )
    assert checked.rc == 0 and checked.report is not None, checked.output
    same_findings(report, checked.report)
    # Under check the callback stands by: one doctor, one report.
    assert "ddp-doctor report after" not in checked.output


def test_two_heads_seed000_freeze_the_unused_head_and_run_clean(tmp_path: Path) -> None:
    run = torchrun("hf_two_heads.py", [str(tmp_path / "out")], tmp_path)
    assert run.finished, run.output[-6000:]
    report = load(tmp_path / "out" / "ddp_doctor.json", run)
    assert codes(report) == {"unused-parameters"}
    unused = finding(report, "unused-parameters")
    assert unused["severity"] == "warning"  # the Trainer's find_unused_parameters=True copes, at a cost
    assert params(report, "unused-parameters") == SCORE_HEAD
    import transformers

    if transformers.__version__.startswith("4."):  # no ddp_static_graph field: the subclass route (4.57.6)
        assert "has no field for static_graph: subclass Trainer" in unused["fix"], unused["fix"]
    else:
        assert "set TrainingArguments(ddp_static_graph=True) (same params unused every step)" in unused["fix"]
    assert "before trainer.train()" in unused["fix"]
    rec = report["recommendation"]
    assert set(rec["freeze_before_wrap"]) == SCORE_HEAD
    assert (rec["find_unused_parameters"], rec["static_graph"]) == (False, False)
    code = rec["render"]["transformers"]
    assert "model.get_parameter(name).requires_grad_(False)" in code and "'score_head.weight'" in code
    assert "ddp_find_unused_parameters=False" in code

    checked = check(
        ["--nproc-per-node", "2", "--steps", "4", str(SCRIPTS / "hf_two_heads.py"), str(tmp_path / "c")],
        tmp_path / "check",
    )
    assert checked.rc == 0 and checked.report is not None, checked.output
    same_findings(report, checked.report)

    # The recommendation, applied: the head frozen before train(), ddp_find_unused_parameters=False.
    fixed = torchrun("hf_two_heads.py", [str(tmp_path / "fixed"), "--fix", "freeze"], tmp_path)
    assert fixed.finished, fixed.output[-6000:]
    clean = load(tmp_path / "fixed" / "ddp_doctor.json", fixed)
    assert clean["findings"] == [] and clean["recommendation"]["verified"] is True
    assert clean["ddp_config"]["find_unused_parameters"] is False
