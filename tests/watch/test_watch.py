"""`ddp-doctor watch`: the whole job runs as it would under torchrun, its first steps are diagnosed while it goes on,
a hang is explained while it happens (before the process group's timeout ends the job), and `ddp-doctor explain`
says it again from the run folder.

Ground truth under plain torchrun (torch 2.13.0, gloo, this 2-core machine), tests/scripts/watch_job.py:
- STALL=loop on rank 1 after step 15, group timeout 10 s: rank 0 raised gloo's *Timed out waiting 10000ms for recv
  operation to complete* from its next backward after 10 s, torchrun sent SIGTERM to rank 1 and exited 1 (15.7 s);
  torchrun's summary names rank 0 (exit code 1) as the failure, not rank 1, which never left its loop.
- STALL=exit on rank 1 after step 15: rank 0 raised *Connection closed by peer* at once; exit code 1 (6.2 s).
- tests/scripts/ckpt_barrier.py (rank 0 calls `dist.barrier()` inside its rank-0-only save): see
  test_check_tree_state.py; both ranks time out (rank 0 in the barrier, rank 1 in DDP's next all-reduce).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from checkrun import EXAMPLES, REPO, SCRIPTS, assert_no_leftovers, free_port
from frameworkrun import ran_to_end


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


def _watch(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 180) -> Watched:
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


def _explain(run_dir: Path, tmp_path: Path) -> tuple[int, str, dict[str, Any] | None]:
    out = tmp_path / "explained.json"
    done = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "explain", str(run_dir), "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr, json.loads(out.read_text()) if out.exists() else None


def _line(script: str, text: str) -> str:
    """`script.py:N` of the line of tests/scripts/`script` that contains `text`."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def _checksums(output: str) -> dict[int, str]:
    return {int(r): c for r, c in re.findall(r"rank (\d) trained \d+ steps, checksum (-?\d+\.\d{12})", output)}


def test_a_clean_job_runs_to_its_end_computing_what_it_computes_under_torchrun(tmp_path: Path) -> None:
    """30 steps where the check observes 8: every rank trains all 30, its weights end bit for bit as under plain
    torchrun, its non-daemon thread is joined and its atexit handler runs, as at any interpreter's end. A
    --hang-after longer than the group's timeout is warned about with both values."""
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran_to_end(plain), plain.stderr[-3000:]  # torch 2.13's abort at exit aside
    run = _watch(
        ["--nproc-per-node", "2", "--hang-after", "90", str(SCRIPTS / "watch_job.py")], tmp_path, env={"STEP_S": "0.15"}
    )
    assert run.rc == 0, run.output
    assert run.report is not None and run.report["findings"] == [], run.output
    assert _checksums(run.output) == _checksums(plain.stdout) and len(_checksums(plain.stdout)) == 2, run.output
    for rank in (0, 1):
        assert f"rank {rank} thread joined" in run.output and f"rank {rank} atexit ran" in run.output, run.output
    ended = run.ended
    assert ended["failed"] is False and ended["steps"] == 30, ended
    assert ended["replicas"] == {
        "schema": "ddp-doctor/replicas@1",
        "compared_steps": [16],  # past the 8 observed steps, every 16th (steps of 0.15 s: the fewest allowed)
        "ranks": [0, 1],
        "divergence": None,
    }, ended
    assert ended["windows"]["windows"] == [], ended  # 22 watched steps: no window of 32 closed
    assert run.hang is None
    assert "--hang-after 90 s" in run.output and "(60 s)" in run.output, run.output
    # The first steps' report came while the job went on (22 steps of 0.15 s at least): before its last lines.
    assert run.output.index("the first steps are diagnosed") < run.output.index("rank 0 trained 30 steps")


def test_a_job_that_becomes_input_bound_past_its_first_steps_is_named_from_its_first_slow_window(
    tmp_path: Path,
) -> None:
    """200 steps whose batches come from a DataLoader without workers; from step 100 on each item takes 40 ms to
    read (SLOW_FROM=100, SLOW_S=0.04), on both ranks. Under plain torchrun the job ends with status 0 and nothing
    said (both ranks' weights end with checksum -2.635275349603, as under watch). Under watch, past the 8 observed
    steps each rank writes a window of 32 steps at a time: the windows before
    step 100 are not input-bound, the first window that lies wholly past it is, for both ranks, and the job goes on
    to its end (exit 0: a window's finding is said, not failed on)."""
    env = {"STEPS": "200", "SLOW_FROM": "100", "SLOW_S": "0.04"}
    run = _watch(["--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")], tmp_path, env=env)
    assert run.rc == 0, run.output
    windows = run.ended["windows"]
    assert windows["schema"] == "ddp-doctor/windows@1" and windows["window"] == 32, windows
    judged = windows["windows"]
    assert all(w["ranks"] == [0, 1] for w in judged) and len(judged) >= 4, judged
    before = [w for w in judged if w["last"] < 100]
    after = [w for w in judged if w["first"] > 101]  # step 101 is the first whose batch (item 100) was slow
    assert before and not any(w["input_bound"] for w in before), judged
    assert after and all(w["input_bound"] and w["waiting"] == [0, 1] for w in after), judged
    assert all(w["wait_s"][0] >= 0.03 for w in after), after  # the 40 ms read, measured on each rank
    # `explain` says the same change again from the run folder: the same window, in the same words.
    said = next(line for line in run.output.splitlines() if "input-bound from steps" in line)
    rc, explained, _ = _explain(run.run_dir, tmp_path)
    assert rc == 0 and said in explained, explained


def test_a_rank_whose_reads_become_slow_past_its_first_steps_is_named_a_straggler_from_its_first_slow_window(
    tmp_path: Path,
) -> None:
    """As above, but only rank 1's items take 40 ms to read from step 100 on (SLOW_RANK=1). Under plain torchrun the
    job ends with status 0 and nothing said, in 9.3 s against 5.4 s with no slow read: rank 0 waits for rank 1 in
    DDP's all-reduce at every step. Under watch the windows before step 100 are clean; each window wholly past it
    names rank 1 a straggler (it waits for its data, rank 0 does not), not the job input-bound; the job runs to its
    end (exit 0)."""
    env = {"STEPS": "200", "SLOW_FROM": "100", "SLOW_S": "0.04", "SLOW_RANK": "1"}
    run = _watch(["--nproc-per-node", "2", str(SCRIPTS / "watch_job.py")], tmp_path, env=env)
    assert run.rc == 0, run.output
    judged = run.ended["windows"]["windows"]
    before = [w for w in judged if w["last"] < 100]
    after = [w for w in judged if w["first"] > 101]
    assert before and not any(w["lagging"] or w["input_bound"] for w in before), judged
    # (a window where a busy machine scattered rank 1's steps by more than its wait is not judged waiting: the first
    # steps' rule; seen once in five windows under pytest-xdist)
    lagging = [w for w in after if w["lagging"]]
    assert 2 * len(lagging) > len(after) and all(w["lagging"] == [1] for w in lagging), judged
    assert not any(w["input_bound"] for w in after), judged
    assert all(w["waiting_wait_s"][0] >= 0.03 and w["others_wait_s"] < 0.02 for w in lagging), lagging
    said = next(line for line in run.output.splitlines() if "straggler-rank (rank 1)" in line)
    rc, explained, _ = _explain(run.run_dir, tmp_path)
    assert rc == 0 and said in explained, explained


def test_replicas_that_drift_apart_after_the_first_steps_are_named_while_the_job_goes_on(tmp_path: Path) -> None:
    """Rank 1 alone adds 0.01 to the first layer's bias after step 40, outside DDP's sync. Under plain torchrun
    (STEPS=200) the job ends with status 0 and nothing said; the ranks' final weights differ (checksums -2.2658 on
    rank 0, -2.1058 on rank 1: the 16 bias entries' 0.01 each). Under watch, past the first 8 steps the parameters are compared every 16 steps or more: the first
    compared step after 40 names the bias, both ranks in two groups, and the last step they agreed at; the job runs
    to its end and watch exits 1."""
    env = {"STEPS": "200", "STEP_S": "0.03", "DRIFT_RANK": "1", "DRIFT_STEP": "40"}
    run = _watch(["--nproc-per-node", "2", "--hang-after", "90", str(SCRIPTS / "watch_job.py")], tmp_path, env=env)
    assert run.rc == 1, run.output
    sums = _checksums(run.output)
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
    rc, said, _ = _explain(run.run_dir, tmp_path)
    assert rc == 1 and f"replicas differ at step {d['step']}" in said and "0.bias" in said, said


@pytest.mark.parametrize("drift_at", [40, -1])
def test_a_replicate_model_that_drifts_apart_past_the_first_steps_is_named(tmp_path: Path, drift_at: int) -> None:
    """FSDP2's `replicate`, rank 1 alone adding 0.01 to the head's bias after step 40. Plain torchrun, 120 steps:
    exit 0, head.weight -2.186211 on both ranks (gradients are still all-reduced), head.bias 0.018098 on rank 0 and
    0.057783 on rank 1. Watched, its parameters are compared past the first steps as a DDP model's are."""
    args = ["--nproc-per-node", "2", "--hang-after", "90", str(SCRIPTS / "replicate_train.py"), "--steps", "120"]
    run = _watch([*args, "--drift-at", str(drift_at)], tmp_path)
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
    run = _watch([*args, "--drift-at", "40"], tmp_path, timeout=300)
    d = run.ended["replicas"]["divergence"]
    assert run.rc == 1 and d is not None and d["params"] == ["0.bias"] and d["groups"] == [[1], [3]], run.output


def test_a_barrier_in_a_rank_0_only_save_is_explained_before_the_groups_timeout(tmp_path: Path) -> None:
    """The hang is called while every rank still waits (no rank had ended: the group's 60 s timeout had not
    fired), with the barrier's line, rank 1's DDP all-reduce, and each rank's stacks; `explain` says the same
    afterwards."""
    run = _watch(
        ["--nproc-per-node", "2", "--hang-after", "3", "--on-hang", "stop", str(SCRIPTS / "ckpt_barrier.py")],
        tmp_path,
        env={"GROUP_TIMEOUT_S": "60"},
    )
    assert run.rc == 1, run.output
    hang = run.hang
    assert hang is not None, run.output
    assert [p["ended"] for p in hang["positions"]] == [None, None], hang["positions"]
    assert hang["group_timeout_s"] == 60 and hang["hang_after_s"] == 3, hang
    cause = hang["findings"][0]
    barrier = _line("ckpt_barrier.py", "dist.barrier()")
    assert cause["code"] == "collective-mismatch" and cause["ranks"] == [0, 1], cause
    assert barrier in cause["title"] and "DDP's next gradient all-reduce" in cause["detail"], cause
    # The ranks' Flight Recorder rings (every collective, DDP's own too) part at the same place.
    (parted,) = hang["sequences"]
    assert parted["ranks"] == [0, 1] and hang["sequences_compared"] == 2, parted
    assert f"rank 0 issued barrier at {SCRIPTS / barrier}" in parted["title"], parted  # the script's line, not ours
    assert "rank 1 issued all_reduce" in parted["title"], parted
    stacks = [Path(p["stacks"]) for p in hang["positions"]]
    assert all("Thread" in s.read_text() for s in stacks), stacks
    assert "ckpt_barrier.py" in stacks[0].read_text()
    assert run.report["findings"][0]["code"] == "collective-mismatch", run.report["findings"]
    assert run.ended["failed"] is True

    rc, output, explained = _explain(run.run_dir, tmp_path)
    assert rc == 1, output
    assert explained is not None and explained["findings"][0]["code"] == "collective-mismatch", output
    assert barrier in output


def test_flight_recorder_dumps_of_the_same_hang_name_the_same_collective_and_ranks(tmp_path: Path) -> None:
    """The rank-0-only barrier under plain torchrun with PyTorch's Flight Recorder on (TORCH_FR_BUFFER_SIZE) and a
    5 s group timeout; each rank writes its dump when its collective times out (gloo records the entries but, on
    torch 2.13.0, writes no dump itself; NCCL's watchdog does). On these dumps torch's own analyzer
    (`python -m torch.distributed.flight_recorder.fr_trace DIR -p rank_`, torch 2.13.0) stops with
    `KeyError: ('0', 0)`. `explain` names what `watch`'s verdict names: the barrier on rank 0 where rank 1 issued
    DDP's gradient all-reduce, each with its line."""
    dumps = tmp_path / "fr"
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPTS / "ckpt_barrier.py")],
        cwd=REPO,
        env={**os.environ, "GROUP_TIMEOUT_S": "5", "FR_DUMP_DIR": str(dumps), "TORCH_FR_BUFFER_SIZE": "2000"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode != 0 and sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1"], plain.stderr
    rc, output, explained = _explain(dumps, tmp_path)
    assert rc == 1, output
    (finding,) = explained["findings"]
    assert finding["code"] == "collective-mismatch" and finding["ranks"] == [0, 1], finding
    barrier, backward = _line("ckpt_barrier.py", "dist.barrier()"), _line("ckpt_barrier.py", "loss.backward()")
    assert f"rank 0 issued barrier at {SCRIPTS.parent.parent / 'tests' / 'scripts' / barrier}" in finding["title"]
    assert "rank 1 issued all_reduce(float[178]) at" in finding["title"] and backward in finding["title"], finding


@pytest.mark.parametrize(
    ("stall", "on_hang", "rank", "text"),
    [
        ("loop", "stop", 1, "while time.monotonic() < until"),
        ("sleep", "wait", 0, "time.sleep(seconds)"),
        ("loader", "stop", 1, "x, y = next(batches)"),
    ],
)
def test_a_rank_in_its_own_code_is_named_while_the_others_wait_in_ddps_all_reduce(
    tmp_path: Path, stall: str, on_hang: str, rank: int, text: str
) -> None:
    """A rank that spins in a Python loop, sleeps, or waits for its DataLoader's worker (stuck 9 s on one item) after
    step 15 while the other waits in DDP's gradient all-reduce: the verdict names that rank and its line, not the rank
    that waits, and the ranks' Flight Recorder rings part at DDP's next all-reduce, which only the waiting rank
    issued. With --on-hang wait, a rank that was only slow (9 s asleep) moves again, and the job finishes."""
    run = _watch(
        ["--nproc-per-node", "2", "--hang-after", "3", "--on-hang", on_hang, str(SCRIPTS / "watch_job.py")],
        tmp_path,
        env={"GROUP_TIMEOUT_S": "60", "STALL": stall, "STALL_S": "9", "STALL_RANK": str(rank), "STALL_STEP": "15"},
    )
    hang = run.hang
    assert hang is not None, run.output
    cause = hang["findings"][0]
    assert cause["code"] == "rank-hung" and cause["ranks"] == [rank], cause
    assert _line("watch_job.py", text) in cause["detail"], cause
    (parted,) = hang["sequences"]  # DDP's next all-reduce, issued by the waiting rank only
    assert f"rank {rank} issued none" in parted["title"] and "all_reduce" in parted["title"], parted
    if on_hang == "stop":
        assert run.rc == 1 and run.ended["failed"] is True, run.output
    else:
        assert run.rc == 0 and run.ended["failed"] is False, run.output
        assert "move again" in run.output and len(_checksums(run.output)) == 2, run.output


def test_a_rank_killed_by_sigkill_is_named_with_its_step_and_no_hang_is_called(tmp_path: Path) -> None:
    """Rank 1 kills itself with SIGKILL after step 15: torchrun sees its worker die and stops the other at once
    (under plain torchrun too), so no hang is called; the report names rank 1, SIGKILL and the watched step."""
    run = _watch(
        ["--nproc-per-node", "2", "--hang-after", "30", str(SCRIPTS / "watch_job.py")],
        tmp_path,
        env={"STALL": "kill", "STALL_RANK": "1", "STALL_STEP": "15"},
    )
    assert run.rc == 1 and run.hang is None, run.output
    first = run.report["findings"][0]
    assert first["code"] == "rank-crashed" and first["ranks"] == [1] and "SIGKILL" in first["title"], first
    assert first["steps"] == [15], first


def test_a_rank_that_leaves_the_loop_early_is_named_after_the_job_failed(tmp_path: Path) -> None:
    """Rank 1 returns from its loop after step 15 (exit status 0); rank 0's next all-reduce fails at once
    (*Connection closed by peer*): no hang, a failed job whose report names rank 1's exit first, then the first
    steps' findings."""
    run = _watch(
        ["--nproc-per-node", "2", "--hang-after", "30", str(SCRIPTS / "watch_job.py")],
        tmp_path,
        env={"STALL": "exit", "STALL_RANK": "1", "STALL_STEP": "15"},
    )
    assert run.rc == 1, run.output
    assert run.hang is None
    first = run.report["findings"][0]
    assert first["code"] == "rank-exited" and first["ranks"] == [1] and first["steps"] == [15], first
    assert run.ended["failed"] is True


def _two_nodes(
    tmp_path: Path, env: dict[str, str], options: list[str], *, timeout: float
) -> tuple[list[int], list[str]]:
    """Two torchrun agents on this machine (`--nnodes 2`, c10d rendezvous on 127.0.0.1), one rank each, each under
    its own `watch` with `options` and its own run folder `node{N}`: their exit codes and outputs, once both ended
    and nothing of the job is left."""
    port = free_port()
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"watch-{port}"]
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


def test_two_nodes_each_watched_explain_the_hang_from_both_nodes_ranks(tmp_path: Path) -> None:
    """Two torchrun agents on this machine (`--nnodes 2`, c10d rendezvous on 127.0.0.1), one rank each, each under
    its own `watch` with `--hang-after 3` and its own run folder (no shared file system); rank 1 spins in a Python
    loop for 25 s after step 15 while rank 0 waits for it in DDP's backward, until the group's 20 s timeout. The
    nodes share their ranks' records through the rendezvous store: each node's verdict holds both ranks and names
    rank 1, with its loop's line, as the rank the other waits for. (`--on-hang wait`: a node that stopped its own
    ranks at its verdict would end the other node's job, through the rendezvous, before that node's verdict.)"""
    env = {"GROUP_TIMEOUT_S": "20", "STALL": "loop", "STALL_RANK": "1", "STALL_STEP": "15", "STALL_S": "25"}
    codes, outputs = _two_nodes(tmp_path, env, ["--hang-after", "3"], timeout=180)
    assert codes == [1, 1], outputs
    # c10d's rendezvous hands out the global ranks in the order the agents join: find each node's own rank by its
    # run folder's records.
    own = {n: int(next((tmp_path / f"node{n}").glob("rank*.beacon")).name[4:-7]) for n in (0, 1)}
    assert sorted(own.values()) == [0, 1], own
    for n in (0, 1):
        hang = json.loads((tmp_path / f"node{n}" / "hang.json").read_text())
        assert [p["rank"] for p in hang["positions"]] == [0, 1], (n, hang["positions"])
        stuck = hang["findings"][0]
        assert stuck["code"] == "rank-hung" and stuck["ranks"] == [1], (n, stuck)
        assert _line("watch_job.py", "while time.monotonic() < until") in stuck["detail"], (n, stuck)
        # The stacks are each node's own ranks'.
        stacks = {p["rank"]: p["stacks"] for p in hang["positions"]}
        assert stacks[own[n]] is not None and stacks[1 - own[n]] is None, (n, stacks)
        # Each node's verdict reads its own ranks' Flight Recorder rings only: one ring, nothing to compare it with.
        assert hang["sequences_compared"] == 1 and hang["sequences"] == [], hang


@pytest.mark.serial  # the windows' verdict rests on each rank's wall-clock waits; two agents at once
def test_two_nodes_judge_each_window_over_both_nodes_ranks(tmp_path: Path) -> None:
    """Two torchrun agents on this machine, one rank each, each under its own `watch` and run folder; rank 1's reads
    take 40 ms from step 100 on (SLOW_RANK=1; under plain torchrun on one node the job ends with status 0, nothing
    said, rank 0 waiting for rank 1 in DDP's all-reduce). Judged on its own, the node of rank 1 would call its one
    rank input-bound; through the rendezvous store each node judges the windows past step 100 over both ranks:
    rank 1 waits for its data alone, a straggler, and the job is not input-bound."""
    env = {"STEPS": "300", "SLOW_FROM": "100", "SLOW_S": "0.04", "SLOW_RANK": "1"}
    codes, outputs = _two_nodes(tmp_path, env, [], timeout=240)
    assert codes == [0, 0], outputs
    for n in (0, 1):
        judged = json.loads((tmp_path / f"node{n}" / "windows.json").read_text())["windows"]
        after = [w for w in judged if w["first"] > 101]
        assert judged and all(w["ranks"] == [0, 1] for w in judged), (n, judged)
        lagging = [w for w in after if w["lagging"]]  # a busy machine may leave a window unjudged, as above
        assert 2 * len(lagging) > len(after) and all(w["lagging"] == [1] for w in lagging), (n, judged)
        assert not any(w["input_bound"] for w in after), (n, judged)


def test_sigterm_to_watch_while_the_job_trains_on_ends_every_process(tmp_path: Path) -> None:
    """SIGTERM to `watch` after the first steps' report, while the job trains on: exit code 143, the partial report
    and the run folder's end record, and no process of the job left (a /proc scan)."""
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddp_doctor.cli", "watch", "--run-dir", str(run_dir), "--nproc-per-node", "2"]
        + [str(SCRIPTS / "watch_job.py")],
        cwd=REPO,
        env={**os.environ, "STEP_S": "0.5", "DDP_DOCTOR_TEST_TAG": tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "the first steps are diagnosed" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=60)
    output = "".join(lines) + rest
    assert proc.returncode == 143, output
    assert "interrupted by SIGTERM" in output and "trained 30 steps" not in output, output
    assert json.loads((run_dir / "watch.json").read_text())["failed"] is True
    assert_no_leftovers(tag)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--hang-after", "0"], "--hang-after must be a positive number of seconds, got 0"),
        (["--run-dir", "/proc/version/run"], "the run folder '/proc/version/run' cannot be written"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be a positive number of processes"),
    ],
)
def test_bad_watch_arguments_are_named_with_the_fix(args: list[str], needle: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "watch", "--nproc-per-node", "2", *args, str(EXAMPLES / "clean.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and needle in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_explain_names_a_folder_without_records(tmp_path: Path) -> None:
    rc, output, _ = _explain(tmp_path, tmp_path)
    assert rc == 2 and "holds no ddp-doctor records" in output and "Traceback" not in output, output
    rc, output, _ = _explain(tmp_path / "nowhere", tmp_path)
    assert rc == 2 and "is not a folder" in output, output
