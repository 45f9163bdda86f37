"""`ddp-doctor watch` past the first steps: replicas that drift apart (DDP, `replicate`, HSDP's replicate dimension)
are named while the job goes on. The parts (what a rank writes, what the parent compares) are in
test_watch_replicas.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS
from watchrun import checksums, explain, watch


def test_replicas_that_drift_apart_after_the_first_steps_are_named_while_the_job_goes_on(tmp_path: Path) -> None:
    """Rank 1 alone adds 0.01 to the first layer's bias after step 40, outside DDP's sync. Under plain torchrun
    (STEPS=200) the job ends with status 0 and nothing said; the ranks' final weights differ (checksums -2.2658 on
    rank 0, -2.1058 on rank 1: the 16 bias entries' 0.01 each). Under watch, past the first 8 steps the parameters are compared every 16 steps or more: the first
    compared step after 40 names the bias, both ranks in two groups, and the last step they agreed at; the job runs
    to its end and watch exits 1."""
    env = {"STEPS": "200", "STEP_S": "0.03", "DRIFT_RANK": "1", "DRIFT_STEP": "40"}
    run = watch(["--nproc-per-node", "2", "--hang-after", "90", str(SCRIPTS / "watch_job.py")], tmp_path, env=env)
    assert run.rc == 1, run.output
    sums = checksums(run.output)
    assert len(sums) == 2 and sums[0] != sums[1], run.output  # the job ran to its end, apart
    replicas = run.ended["replicas"]
    d = replicas["divergence"]
    assert d is not None and d["params"] == ["0.bias"] and d["differing"] == 1 and d["groups"] == [[0], [1]], d
    assert d["step"] > 40 and d["step"] % 16 == 0 and (d["agreed_step"] is None or d["agreed_step"] <= 40), d
    assert replicas["compared_steps"][-1] == d["step"] and replicas["ranks"] == [0, 1], replicas
    assert run.ended["failed"] is False and "replicas' parameters differed from step" in run.ended["summary"]
    assert f"replicas differ at step {d['step']}" in run.output, run.output
    # Said while the job went on: before the ranks' last lines.
    assert run.output.index(f"replicas differ at step {d['step']}") < run.output.index("rank 0 trained 200 steps")
    rc, said, _ = explain(run.run_dir, tmp_path)
    assert rc == 1 and f"replicas differ at step {d['step']}" in said and "0.bias" in said, said


@pytest.mark.parametrize("drift_at", [40, -1])
def test_a_replicate_model_that_drifts_apart_past_the_first_steps_is_named(tmp_path: Path, drift_at: int) -> None:
    """FSDP2's `replicate`, rank 1 alone adding 0.01 to the head's bias after step 40. Plain torchrun, 120 steps:
    exit 0, head.weight -2.186211 on both ranks (gradients are still all-reduced), head.bias 0.018098 on rank 0 and
    0.057783 on rank 1. Watched, its parameters are compared past the first steps as a DDP model's are."""
    args = ["--nproc-per-node", "2", "--hang-after", "90", str(SCRIPTS / "replicate_train.py"), "--steps", "120"]
    run = watch([*args, "--drift-at", str(drift_at)], tmp_path)
    d, compared = run.ended["replicas"]["divergence"], run.ended["replicas"]["compared_steps"]
    if drift_at < 0:  # equal replicas, compared
        assert run.rc == 0 and d is None and compared, (run.output, compared)
        return
    assert run.rc == 1, run.output
    assert d is not None and d["params"] == ["head.bias"] and d["groups"] == [[0], [1]] and d["step"] > 40, d


def test_an_hsdp_shard_that_drifts_from_its_replica_is_named(tmp_path: Path) -> None:
    """HSDP on a [2, 2] mesh (4 ranks), rank 1 adding 0.01 to its shard of the first bias after step 40. Plain
    torchrun, 120 steps: exit 0; that shard sums -2.106096 on rank 1 and -2.264837 on rank 3, its replica (ranks 0
    and 2, the other shard: -2.051094 both). Watched: compared among the ranks holding the same shard."""
    args = ["--nproc-per-node", "4", "--hang-after", "90", str(SCRIPTS / "fsdp2_hsdp.py"), "--steps", "120"]
    run = watch([*args, "--drift-at", "40"], tmp_path, timeout=300)
    d = run.ended["replicas"]["divergence"]
    assert run.rc == 1 and d is not None and d["params"] == ["0.bias"] and d["groups"] == [[1], [3]], run.output


@pytest.mark.parametrize("case", ["averaged", "no-averager"])
def test_post_local_sgd_replicas_are_compared_right_after_each_model_averaging(tmp_path: Path, case: str) -> None:
    """tests/scripts/local_sgd.py, 64 steps (ground truth in tests/sync/test_check_local_sgd.py): under post-local SGD
    the replicas differ after every optimizer step by design and are equal right after each model averaging (every
    4 steps). watch compares them there, not at its usual steps: averaged ends clean with the points taken after
    averagings; no-averager (the replicas never meet again) has no point to compare, and says why."""
    script = str(SCRIPTS / "local_sgd.py")
    run = watch(["--nproc-per-node", "2", script, str(tmp_path / "out"), "--case", case, "--steps", "64"], tmp_path)
    assert run.rc == 0, run.output
    replicas = run.ended["replicas"]
    assert replicas["divergence"] is None and replicas["local_sgd"] is True, replicas
    if case == "averaged":
        steps = replicas["compared_steps"]
        assert steps and all(s % 4 == 0 for s in steps) and replicas["after_averaging"] is True, replicas
    else:
        assert replicas["compared_steps"] == [] and "model averaging" in run.ended["summary"], run.ended
