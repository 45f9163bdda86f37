"""`ddp-doctor check`'s command line: bad input and usage errors (exit 2 naming the value and the fix), help, a
module run like `python -m`, a script that never builds DDP, and a bug of ours (never a clean report)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from checkrun import EXAMPLES, REPO, SCRIPTS, check, line_of


def test_a_script_that_never_builds_ddp_is_a_clear_exit_2(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "no_training.py")], tmp_path)
    if "connectFullMesh failed" in run.output:
        # gloo failed to connect the two ranks inside init_process_group (seen once in CI under pytest-xdist, not
        # reproduced in 12 runs): the machine's, not the verdict under test; once more
        run = check(["--nproc-per-node", "2", str(SCRIPTS / "no_training.py")], tmp_path)
    assert run.rc == 2, run.output
    assert "without building a torch.nn.parallel.DistributedDataParallel model" in run.output
    assert "Traceback" not in run.output


def test_a_script_that_exits_before_building_ddp_is_named_with_its_status_and_line(tmp_path: Path) -> None:
    """Plain torchrun, an argument the script's argparse does not accept: both ranks print the usage and exit with
    status 2 at `parser.parse_args()`, torchrun fails. The check said the script "ran to the end without building"
    a DDP model."""
    script = SCRIPTS / "replicate_train.py"
    run = check(["--nproc-per-node", "2", str(script), "--no-such-flag"], tmp_path)
    assert run.rc == 2, run.output
    line = f"tests/scripts/replicate_train.py:{line_of(script, 'args = parser.parse_args()')}"
    assert f"exited with status 2 at {line}" in run.output and "on ranks 0, 1" in run.output, run.output
    assert "ran to the end" not in run.output and "Traceback" not in run.output, run.output


def test_freeze_before_wrap_with_an_unknown_name_is_exit_2_naming_it(tmp_path: Path) -> None:
    run = check(
        [
            "--nproc-per-node",
            "2",
            "--ddp-kwargs",
            '{"freeze_before_wrap": ["encoder.nope"]}',
            str(EXAMPLES / "clean.py"),
        ],
        tmp_path,
    )
    assert run.rc == 2, run.output
    assert "encoder.nope" in run.output and "0.weight" in run.output


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_bad_input_is_exit_2_with_the_value_and_the_fix() -> None:
    missing = _cli("--nproc-per-node", "2", "no/such/train.py")
    assert missing.returncode == 2 and "'no/such/train.py' does not exist" in missing.stderr
    typo = _cli("--ddp-kwargs", '{"static_graf": true}', str(EXAMPLES / "clean.py"))
    assert typo.returncode == 2 and "['static_graf']" in typo.stderr and "static_graph" in typo.stderr
    not_json = _cli("--ddp-kwargs", "static_graph=True", str(EXAMPLES / "clean.py"))
    assert not_json.returncode == 2 and "not valid JSON" in not_json.stderr
    no_python = _cli("--no-python", str(EXAMPLES / "clean.py"))
    assert no_python.returncode == 2 and "--no-python" in no_python.stderr
    for result in (missing, typo, not_json, no_python):
        assert "Traceback" not in result.stderr


def test_help_shows_examples_and_torchrun_options() -> None:
    out = _cli("--help").stdout
    assert "examples:" in out and "--rdzv-endpoint" in out and "--ddp-kwargs" in out and "--nnodes 2" in out


def test_a_module_runs_like_python_dash_m_with_its_arguments(tmp_path: Path) -> None:
    run = check(
        ["--nproc-per-node", "2", "--steps", "4", "-m", "tests.scripts.as_module", "--steps-total", "12"], tmp_path
    )
    assert run.rc == 0, run.output
    assert run.codes == {"find-unused-unneeded"} and run.report["steps_observed"] == 4, run.output


def test_an_internal_error_of_the_doctor_is_exit_2_never_a_clean_report(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "internal_error.py")], tmp_path)
    assert run.rc == 2, run.output
    assert "internal error: AttributeError: simulated bug inside ddp-doctor" in run.output, run.output
    assert "No problems found" not in run.output, run.output
    assert run.report is None or not run.report.get("findings"), run.report
