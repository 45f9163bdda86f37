"""Run `ddp-doctor check` as a real subprocess, the way a user does, and check that it left no process behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def line_of(script: str | Path, text: str) -> int:
    """The 1-based number of the one line of `script` that holds `text` (so tests name a line without pinning it)."""
    found = [n for n, line in enumerate(Path(script).read_text().splitlines(), 1) if text in line]
    assert len(found) == 1, (script, text, found)
    return found[0]


@dataclass
class Run:
    rc: int
    output: str
    report: dict[str, Any] | None
    seconds: float

    @property
    def codes(self) -> set[str]:
        return {f["code"] for f in self.report["findings"]} if self.report else set()

    def finding(self, code: str) -> dict[str, Any]:
        assert self.report is not None, self.output
        found = [f for f in self.report["findings"] if f["code"] == code]
        assert found, f"no {code} finding in {sorted(self.codes)}\n{self.output}"
        return found[0]

    def params(self, code: str) -> set[str]:
        return {p["name"] for p in self.finding(code)["params"]}

    def errors(self) -> list[str]:
        return [f["code"] for f in self.report["findings"] if f["severity"] == "error"] if self.report else []


def start(args: list[str], tmp_path: Path, *, tag: str | None = None, name: str = "report.json") -> tuple[Any, Path]:
    """Start `ddp-doctor check ARGS` in the background; returns (process, json path)."""
    out = tmp_path / name
    env = {**os.environ, "DDP_DOCTOR_TEST_TAG": tag or uuid.uuid4().hex}
    cmd = [sys.executable, "-m", "ddp_doctor.cli", "check", "--json", str(out), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.tag = env["DDP_DOCTOR_TEST_TAG"]  # type: ignore[attr-defined]
    return proc, out


def finish(proc: Any, out: Path, *, timeout: float = 120.0, started: float | None = None) -> Run:
    started = time.monotonic() if started is None else started
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"ddp-doctor check did not end within {timeout} s:\n{output}") from None
    seconds = time.monotonic() - started
    assert_no_leftovers(proc.tag)
    report = json.loads(out.read_text()) if out.exists() else None
    assert_clean_reports_say_what_they_compared(report, output)
    return Run(rc=proc.returncode, output=output, report=report, seconds=seconds)


def assert_clean_reports_say_what_they_compared(report: dict[str, Any] | None, output: str) -> None:
    """Every report of a run without findings that observed steps states what it compared across the ranks, with
    counts (its `compared`: ranks, steps, parameters), or says that it compared nothing; and the output never says
    "No problems found." alone: so no test of a clean run passes on the absence of findings alone."""
    reports = [report, *(m.get("report") or {} for m in report.get("models") or [])] if report else []
    for r in reports:
        if r.get("findings") == [] and not r.get("failed") and r.get("steps_observed", 0) > 0:
            c = r.get("compared") or {}
            assert min(c.get("ranks", 0), c.get("steps", 0)) >= 1, (c, output)
            assert c.get("parameters", 0) >= 1 or "Nothing was compared across ranks" in output, (c, output)
    assert "No problems found." not in output, output


def check(args: list[str], tmp_path: Path, *, timeout: float = 120.0) -> Run:
    """Run `ddp-doctor check --json FILE ARGS` to the end."""
    started = time.monotonic()
    proc, out = start(args, tmp_path)
    return finish(proc, out, timeout=timeout, started=started)


def assert_no_leftovers(tag: str) -> None:
    """No live process (torchrun, rank, or a rank's child) carries this run's tag in its environment."""
    marker = f"DDP_DOCTOR_TEST_TAG={tag}".encode()
    deadline = time.monotonic() + 3.0
    while True:
        alive = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (
                    marker in (entry / "environ").read_bytes().split(b"\0")
                    and (entry / "stat").read_text().split(")")[-1].split()[0] != "Z"
                ):
                    alive.append((entry.name, (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:200]))
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not alive, f"processes left behind: {alive}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
