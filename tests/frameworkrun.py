"""Run a framework test script under plain torchrun (2 ranks, CPU, gloo), the way its user would, and check that
it left no process behind. `ddp-doctor check` runs of the same scripts go through `checkrun.check`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkrun import SCRIPTS, assert_no_leftovers

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Nothing is ever downloaded: every model is built from a config in the script."""


_ABORT_AT_EXIT = "terminate called without an active exception"


@dataclass
class Launch:
    rc: int
    output: str
    seconds: float

    @property
    def aborted_at_exit(self) -> bool:
        """A rank died of SIGABRT with the native "terminate called without an active exception", and no rank
        failed otherwise (torchrun's own SIGTERM to the others aside): torch 2.13's gloo quirk at interpreter exit
        (a ProcessGroupGloo worker thread cancelled during finalization, docs/fixes.md), after the script's last
        line. What the script wrote (its reports, its measurements) is there; the test asserts on those. A rank that
        raised first and then aborted the same way while its interpreter exited (seen in CI) failed: its traceback,
        which torch prints with the rank's prefix, says so."""
        codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", self.output)}
        raised = re.search(r"^\[rank\d+\]: Traceback \(most recent call last\)", self.output, re.MULTILINE)
        return self.rc != 0 and not raised and _ABORT_AT_EXIT in self.output and -6 in codes and codes <= {-6, -15}

    @property
    def finished(self) -> bool:
        """The script ran to its end: exit code 0, or the abort at exit above."""
        return self.rc == 0 or self.aborted_at_exit


def ran_to_end(done: subprocess.CompletedProcess[str]) -> bool:
    """A plain torchrun baseline ran its script to the end: exit code 0, or torch 2.13's abort at interpreter exit
    after the script's last line (`Launch.finished`)."""
    return Launch(rc=done.returncode, output=(done.stdout or "") + (done.stderr or ""), seconds=0.0).finished


def torchrun(script: str, args: list[str], cwd: Path, *, timeout: float = 180.0) -> Launch:
    """`torchrun --standalone --nproc-per-node 2 tests/scripts/SCRIPT ARGS` (torchrun picks a free port)."""
    tag = uuid.uuid4().hex
    env = {**os.environ, **OFFLINE, "DDP_DOCTOR_TEST_TAG": tag}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / script),
        *args,
    ]
    started = time.monotonic()
    try:
        out = subprocess.run(
            cmd,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    finally:
        assert_no_leftovers(tag)
    return Launch(rc=out.returncode, output=out.stdout, seconds=time.monotonic() - started)


def codes(report: dict[str, Any]) -> set[str]:
    return {f["code"] for f in report["findings"]}


def finding(report: dict[str, Any], code: str) -> dict[str, Any]:
    found = [f for f in report["findings"] if f["code"] == code]
    assert found, f"no {code} finding in {sorted(codes(report))}"
    return found[0]


def params(report: dict[str, Any], code: str) -> set[str]:
    return {p["name"] for p in finding(report, code)["params"]}


def load(path: Path, launch: Launch) -> dict[str, Any]:
    assert path.exists(), f"no report at {path}:\n{launch.output[-6000:]}"
    return json.loads(path.read_text())


def same_findings(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same codes, severities and parameter names, and the same recommended flags."""

    def key(r: dict[str, Any]) -> set[tuple[str, str, tuple[str, ...]]]:
        return {(f["code"], f["severity"], tuple(sorted(p["name"] for p in f["params"]))) for f in r["findings"]}

    assert key(a) == key(b), (key(a), key(b))
    flags = ("find_unused_parameters", "static_graph", "freeze_before_wrap")
    assert {k: a["recommendation"][k] for k in flags} == {k: b["recommendation"][k] for k in flags}
    assert a["framework"] == b["framework"]
