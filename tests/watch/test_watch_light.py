"""Past the first steps, `watch` keeps only light watching on: the per-step measures of a sharded model (the
gradient shards' scale and norm from a forward hook on the root, the inputs' fingerprints, the settings and modes)
stop when the first steps' report is built (`PlainOptimizerWatch.end_per_step`).

Ground truth, plain torchrun, torch 2.13.0, 2 ranks, 40 steps of tests/scripts/fsdp2_train.py: the root module
carries FSDP2's own forward hooks only, as many at every step (printed by the script with `--hooks-file`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from checkrun import REPO, SCRIPTS, assert_no_leftovers
from frameworkrun import ran_to_end


def _hooks(path: Path) -> dict[int, int]:
    return {int(step): int(n) for step, n in (line.split() for line in path.read_text().splitlines())}


def test_a_watched_fsdp2_job_sheds_the_per_step_hooks_after_its_first_steps(tmp_path: Path) -> None:
    script = [str(SCRIPTS / "fsdp2_train.py"), "--steps", "40"]
    plain_file, watched_file = tmp_path / "plain.txt", tmp_path / "watched.txt"
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
        + ["--hooks-file", str(plain_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert ran_to_end(plain), plain.stderr[-3000:]  # torch 2.13's abort at exit aside
    tag = uuid.uuid4().hex
    watched = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "watch", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2"]
        + [*script, "--hooks-file", str(watched_file)],
        cwd=REPO,
        env={**os.environ, "DDP_DOCTOR_TEST_TAG": tag},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert_no_leftovers(tag)
    assert watched.returncode == 0, watched.stdout[-3000:] + watched.stderr[-3000:]
    ours, theirs = _hooks(watched_file), _hooks(plain_file)
    assert sorted(ours) == sorted(theirs) == list(range(40))
    assert len(set(theirs.values())) == 1, theirs  # FSDP2's own, the same at every step
    # during the observed steps (the first is found at its optimizer step) one hook more: the gradient-scale measure
    assert ours[1] == theirs[1] + 1, (ours, theirs)
    # after the first steps' report, none of ours is left on the root
    assert ours[39] == theirs[39], (ours, theirs)
