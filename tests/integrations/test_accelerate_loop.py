"""Accelerate + ddp_doctor.integrations.accelerate, end to end: a loop meant for `accelerate launch` whose model has
a module the loss never uses, launched by torchrun and by `ddp-doctor check` (Accelerator() reads the same
environment variables), then run again with `kwargs_handler(report)`."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check
from frameworkrun import codes, finding, load, params, same_findings, torchrun

pytestmark = pytest.mark.timeout(300)

AUX = {"aux.weight", "aux.bias"}


def test_unused_module_then_the_recommended_kwargs_handler(tmp_path: Path) -> None:
    run = torchrun("accelerate_unused.py", [str(tmp_path / "out")], tmp_path)
    assert run.finished, run.output[-6000:]
    report = load(tmp_path / "out" / "ddp_doctor.json", run)
    assert report["framework"] == "accelerate" and report["steps_observed"] == 4
    assert codes(report) == {"unused-parameters"} and params(report, "unused-parameters") == AUX
    assert "before accelerator.prepare(model)" in finding(report, "unused-parameters")["fix"]
    rec = report["recommendation"]
    assert set(rec["freeze_before_wrap"]) == AUX and rec["find_unused_parameters"] is False
    assert "DistributedDataParallelKwargs(find_unused_parameters=False" in rec["render"]["accelerate"]

    checked = check(
        ["--nproc-per-node", "2", "--steps", "4", str(SCRIPTS / "accelerate_unused.py"), str(tmp_path / "c")],
        tmp_path / "check",
    )
    assert checked.rc == 0 and checked.report is not None, checked.output
    same_findings(report, checked.report)

    applied = torchrun(
        "accelerate_unused.py",
        [str(tmp_path / "applied"), "--apply", str(tmp_path / "out" / "ddp_doctor.json")],
        tmp_path,
    )
    assert applied.finished, applied.output[-6000:]
    clean = load(tmp_path / "applied" / "ddp_doctor.json", applied)
    assert clean["ddp_config"]["find_unused_parameters"] is False
    assert clean["findings"] == [] and clean["recommendation"]["verified"] is True
