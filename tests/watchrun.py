"""Running `ddp-doctor watch` and `ddp-doctor explain` as a user would, for the tests of tests/watch/: one job, or
two torchrun agents on this machine (`--nnodes 2`), each checked afterwards for leftover processes (a /proc scan)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkrun import REPO, SCRIPTS, assert_no_leftovers, free_port


@dataclass
class Watched:
    rc: int
    output: str
    run_dir: Path
    report: dict[str, Any] | None

    @property
    def hang(self) -> dict[str, Any] | None:
        path = self.run_dir / "hang.json"
        return json.loads(path.read_text()) if path.exists() else None

    @property
    def ended(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "watch.json").read_text())


def watch(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 180) -> Watched:
    run_dir = tmp_path / "run"
    out = tmp_path / "result.json"
    tag = uuid.uuid4().hex
    done = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "watch", "--run-dir", str(run_dir), "--json", str(out), *args],
        cwd=REPO,
        env={**os.environ, **(env or {}), "DDP_DOCTOR_TEST_TAG": tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert_no_leftovers(tag)
    return Watched(done.returncode, done.stdout, run_dir, json.loads(out.read_text()) if out.exists() else None)


def explain(run_dir: Path, tmp_path: Path) -> tuple[int, str, dict[str, Any] | None]:
    out = tmp_path / "explained.json"
    done = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "explain", str(run_dir), "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr, json.loads(out.read_text()) if out.exists() else None


def line(script: str, text: str) -> str:
    """`script.py:N` of the line of tests/scripts/`script` that contains `text`."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def checksums(output: str) -> dict[int, str]:
    return {int(r): c for r, c in re.findall(r"rank (\d) trained \d+ steps, checksum (-?\d+\.\d{12})", output)}


def two_nodes(
    tmp_path: Path, env: dict[str, str], options: list[str], *, timeout: float, static: bool = False
) -> tuple[list[int], list[str]]:
    """Two torchrun agents on this machine (`--nnodes 2`, c10d rendezvous on 127.0.0.1; with `static`, torchrun's
    static rendezvous: `--master-addr 127.0.0.1 --master-port P` and each agent's `--node-rank`), one rank each, each
    under its own `watch` with `options` and its own run folder `node{N}`: their exit codes and outputs, once both
    ended and nothing of the job is left."""
    port = free_port()
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1"]
    if static:
        rdzv += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        rdzv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"watch-{port}"]
    tag = uuid.uuid4().hex
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "ddp_doctor.cli", "watch", "--run-dir", str(tmp_path / f"node{n}"), *options]
            + [*rdzv, "--node-rank", str(n), str(SCRIPTS / "watch_job.py")],
            cwd=REPO,
            env={**os.environ, **env, "DDP_DOCTOR_TEST_TAG": tag},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    outputs = [proc.communicate(timeout=timeout)[0] for proc in nodes]
    assert_no_leftovers(tag)
    return [proc.returncode for proc in nodes], outputs


def plain(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node 2 tests/scripts/SCRIPT` with `env` added, without the doctor: the ground truth."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPTS / script)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
