"""`ddp-doctor demo` runs check on the examples and ends with the summary table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from checkrun import REPO


@pytest.mark.timeout(300)
def test_demo_on_three_examples_prints_the_summary() -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "ddp_doctor.cli", "demo", "--only", "clean", "--only", "find_unused_all_used"),
            *("--only", "fsdp2_optimizer_before_shard"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "140"},  # one table row per example
        timeout=280,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any("ddp-doctor demo: 2 ranks, gloo, CPU" in line for line in lines), out.stdout
    clean = next(line for line in lines if line.startswith("│ clean "))
    # a clean report states what it compared, with counts (clean.py: 8 parameters, 8 steps, 2 ranks)
    assert "│ none (compared 8 params, 8 steps, 2 ranks)" in clean and "keep the script's flags" in clean, out.stdout
    row = next(line for line in lines if line.startswith("│ find_unused_all_used "))
    assert "find-unused-unneeded" in row and "find_unused_parameters=" in row, out.stdout
    fsdp2 = out.stdout[out.stdout.index("│ fsdp2_optimizer_before_shard ") :]
    assert "optimizer-params-rep" in fsdp2 and "build the optimizer" in fsdp2, out.stdout


def test_demo_names_an_unknown_example() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "demo", "--only", "nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "['nope.py'] not found" in out.stderr
