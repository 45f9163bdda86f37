"""`ddp-doctor watch`: a hang explained while it happens (before the process group's timeout ends the job), a rank
that died or left early named after the job failed, on one node and across two; `ddp-doctor explain` says it again
from the run folder.

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
from pathlib import Path

import pytest
from checkrun import SCRIPTS
from watchrun import checksums, explain, line, plain, two_nodes, watch


def test_a_barrier_in_a_rank_0_only_save_is_explained_before_the_groups_timeout(tmp_path: Path) -> None:
    """The hang is called while every rank still waits (no rank had ended: the group's 60 s timeout had not
    fired), with the barrier's line, rank 1's DDP all-reduce, and each rank's stacks; `explain` says the same
    afterwards."""
    run = watch(
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
    barrier = line("ckpt_barrier.py", "dist.barrier()")
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

    rc, output, explained = explain(run.run_dir, tmp_path)
    assert rc == 1, output
    assert explained is not None and explained["findings"][0]["code"] == "collective-mismatch", output
    assert barrier in output


def _explained_dumps(script: str, env: dict[str, str], tmp_path: Path) -> dict:
    """`script` under plain torchrun with the Flight Recorder on and a 5 s group timeout, each rank dumping its ring
    (`FR_DUMP_DIR`); then `explain` on the dumps: its one finding, which names ranks 0 and 1 as parting."""
    dumps = tmp_path / "fr"
    env = {**env, "GROUP_TIMEOUT_S": "5", "FR_DUMP_DIR": str(dumps), "TORCH_FR_BUFFER_SIZE": "2000"}
    done = plain(script, env)
    assert done.returncode != 0 and sorted(p.name for p in dumps.iterdir()) == ["rank_0", "rank_1"], done.stderr
    rc, output, explained = explain(dumps, tmp_path)
    assert rc == 1, output
    (finding,) = explained["findings"]
    assert finding["code"] == "collective-mismatch" and finding["ranks"] == [0, 1], finding
    return finding


def test_flight_recorder_dumps_of_the_same_hang_name_the_same_collective_and_ranks(tmp_path: Path) -> None:
    """The rank-0-only barrier under plain torchrun with PyTorch's Flight Recorder on (TORCH_FR_BUFFER_SIZE) and a
    5 s group timeout; each rank writes its dump when its collective times out (gloo records the entries but, on
    torch 2.13.0, writes no dump itself; NCCL's watchdog does). On these dumps torch's own analyzer
    (`python -m torch.distributed.flight_recorder.fr_trace DIR -p rank_`, torch 2.13.0) stops with
    `KeyError: ('0', 0)`. `explain` names what `watch`'s verdict names: the barrier on rank 0 where rank 1 issued
    DDP's gradient all-reduce, each with its line."""
    finding = _explained_dumps("ckpt_barrier.py", {}, tmp_path)
    barrier, backward = line("ckpt_barrier.py", "dist.barrier()"), line("ckpt_barrier.py", "loss.backward()")
    assert f"rank 0 issued barrier at {SCRIPTS.parent.parent / 'tests' / 'scripts' / barrier}" in finding["title"]
    assert "rank 1 issued all_reduce(float[178]) at" in finding["title"] and backward in finding["title"], finding


@pytest.mark.parametrize("stall", ["loop", "loader"])
def test_flight_recorder_dumps_of_a_rank_held_in_its_own_code_name_the_all_reduce_it_never_issued(
    tmp_path: Path, stall: str
) -> None:
    """tests/scripts/watch_job.py under plain torchrun, Flight Recorder on, 5 s group timeout: rank 1 spins in a
    Python loop (or waits for its DataLoader's worker) for 30 s after step 15. Rank 0 times out in DDP's next gradient
    all-reduce after 5 s and dumps its ring; torchrun names rank 0 as the root cause (exit code 1) and stops rank 1
    with SIGTERM, at which rank 1 dumps its own (as NCCL's watchdog dumps every rank at a timeout). `explain` on the
    dumps names what `watch`'s verdict names for the same hang (test below): the all-reduce from rank 0's backward,
    which rank 1 never issued."""
    env = {"STALL": stall, "STALL_RANK": "1", "STALL_STEP": "15", "STALL_S": "30"}
    finding = _explained_dumps("watch_job.py", env, tmp_path)
    backward = line("watch_job.py", "loss.backward()")
    assert "rank 0 issued all_reduce(float[178]) at" in finding["title"] and backward in finding["title"], finding
    assert "rank 1 issued none" in finding["title"], finding


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
    run = watch(
        ["--nproc-per-node", "2", "--hang-after", "3", "--on-hang", on_hang, str(SCRIPTS / "watch_job.py")],
        tmp_path,
        env={"GROUP_TIMEOUT_S": "60", "STALL": stall, "STALL_S": "9", "STALL_RANK": str(rank), "STALL_STEP": "15"},
    )
    hang = run.hang
    assert hang is not None, run.output
    cause = hang["findings"][0]
    assert cause["code"] == "rank-hung" and cause["ranks"] == [rank], cause
    assert line("watch_job.py", text) in cause["detail"], cause
    (parted,) = hang["sequences"]  # DDP's next all-reduce, issued by the waiting rank only
    assert f"rank {rank} issued none" in parted["title"] and "all_reduce" in parted["title"], parted
    if on_hang == "stop":
        assert run.rc == 1 and run.ended["failed"] is True, run.output
        # The job's report leads with the hang too, even when the ranks' files, read after the stop, no longer tell.
        first = run.report["findings"][0]
        assert (first["code"], first["ranks"]) == ("rank-hung", [rank]), run.report["findings"]
        rc, output, explained = explain(run.run_dir, tmp_path)  # afterwards, from the run folder: the same verdict
        assert rc == 1 and explained is not None, output
        again = explained["hang"]["findings"][0]  # the verdict, as watch printed it
        assert explained["findings"][0]["code"] == "rank-hung", explained["findings"]  # and the report it leads
        assert (again["code"], again["ranks"]) == ("rank-hung", [rank]) and line("watch_job.py", text) in again[
            "detail"
        ]
    else:
        assert run.rc == 0 and run.ended["failed"] is False, run.output
        assert "move again" in run.output and len(checksums(run.output)) == 2, run.output


def test_a_rank_killed_by_sigkill_is_named_with_its_step_and_no_hang_is_called(tmp_path: Path) -> None:
    """Rank 1 kills itself with SIGKILL after step 15: torchrun sees its worker die and stops the other at once
    (under plain torchrun too), so no hang is called; the report names rank 1, SIGKILL and the watched step."""
    run = watch(
        ["--nproc-per-node", "2", "--hang-after", "30", str(SCRIPTS / "watch_job.py")],
        tmp_path,
        env={"STALL": "kill", "STALL_RANK": "1", "STALL_STEP": "15"},
    )
    assert run.rc == 1 and run.hang is None, run.output
    first = run.report["findings"][0]
    assert first["code"] == "rank-crashed" and first["ranks"] == [1] and first["labels"]["signal"] == "SIGKILL", first
    assert first["steps"] == [15], first


def test_a_rank_that_leaves_the_loop_early_is_named_after_the_job_failed(tmp_path: Path) -> None:
    """Rank 1 returns from its loop after step 15 (exit status 0); rank 0's next all-reduce fails at once
    (*Connection closed by peer*): no hang, a failed job whose report names rank 1's exit first, then the first
    steps' findings."""
    run = watch(
        ["--nproc-per-node", "2", "--hang-after", "30", str(SCRIPTS / "watch_job.py")],
        tmp_path,
        env={"STALL": "exit", "STALL_RANK": "1", "STALL_STEP": "15"},
    )
    assert run.rc == 1, run.output
    assert run.hang is None
    first = run.report["findings"][0]
    assert first["code"] == "rank-exited" and first["ranks"] == [1] and first["steps"] == [15], first
    assert run.ended["failed"] is True


@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_two_nodes_each_watched_explain_the_hang_from_both_nodes_ranks(tmp_path: Path, rdzv: str) -> None:
    """Two torchrun agents on this machine (`--nnodes 2`, c10d rendezvous on 127.0.0.1, or the static one with
    `--master-addr` and `--node-rank`), one rank each, each under its own `watch` with `--hang-after 3` and its own
    run folder (no shared file system); rank 1 spins in a Python
    loop for 25 s after step 15 while rank 0 waits for it in DDP's backward, until the group's 20 s timeout. The
    nodes share their ranks' records through the rendezvous store: each node's verdict holds both ranks and names
    rank 1, with its loop's line, as the rank the other waits for. (`--on-hang wait`: a node that stopped its own
    ranks at its verdict would end the other node's job, through the rendezvous, before that node's verdict.)"""
    env = {"GROUP_TIMEOUT_S": "20", "STALL": "loop", "STALL_RANK": "1", "STALL_STEP": "15", "STALL_S": "25"}
    codes, outputs = two_nodes(tmp_path, env, ["--hang-after", "3"], timeout=180, static=rdzv == "static")
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
        assert line("watch_job.py", "while time.monotonic() < until") in stuck["detail"], (n, stuck)
        # The stacks are each node's own ranks'.
        stacks = {p["rank"]: p["stacks"] for p in hang["positions"]}
        assert stacks[own[n]] is not None and stacks[1 - own[n]] is None, (n, stacks)
        # Each node's verdict reads its own ranks' Flight Recorder rings only: one ring, nothing to compare it with.
        assert hang["sequences_compared"] == 1 and hang["sequences"] == [], hang


def test_two_nodes_a_rank_that_leaves_early_on_one_node_is_named_on_the_other(tmp_path: Path) -> None:
    """Two agents under the static rendezvous, one rank each; rank 1 (node 1) leaves its loop and exits with status 0
    after step 15. Under plain torchrun rank 0 raises *Connection closed by peer* at once and node 0's torchrun exits
    1; node 1's exits 0 (its exit barrier fails at once: the store went with node 0's agent), and neither says which
    rank left. (Under c10d's rendezvous the agent that hosts the store is the first to join: when it is node 1's,
    torchrun keeps node 1 in its exit barrier for 300 s, with or without the doctor; the doctor's part, tried by
    hand there, is the same.) Under watch, rank 1 sets its end record in the job's store before it exits, and
    rank 0, losing its peer, writes it in its run folder's "nodes": node 0's report leads with rank 1's exit at step
    15 and its line (not with rank 0's lost connection), and `explain` on node 0's folder says the same; node 1 says
    its own ranks finished (not the job). Both print the first steps' report before the end."""
    env = {"STALL": "exit", "STALL_RANK": "1", "STALL_STEP": "15"}
    codes, outputs = two_nodes(tmp_path, env, [], timeout=180, static=True)
    assert codes == [1, 0], outputs
    ended = [json.loads((tmp_path / f"node{n}" / "watch.json").read_text()) for n in (0, 1)]
    node = {own: n for n in (0, 1) for own in ended[n]["ranks"]}
    failed, finished = ended[node[0]], ended[node[1]]
    assert (failed["failed"], finished["failed"]) == (True, False), ended
    assert finished["steps"] == 15 and failed["result"]["steps_observed"] == 8, ended
    assert all((tmp_path / f"node{n}" / "report.steps.json").exists() for n in (0, 1))  # the first steps' report
    exited = line("watch_job.py", "sys.exit(0)")
    first = failed["result"]["findings"][0]
    assert (first["code"], first["ranks"], first["steps"]) == ("rank-exited", [1], [15]), first
    assert exited in first["detail"], first
    rc, output, explained = explain(tmp_path / f"node{node[0]}", tmp_path)
    assert rc == 1 and explained is not None, output
    again = explained["findings"][0]
    assert (again["code"], again["ranks"], again["steps"]) == ("rank-exited", [1], [15]), again
    assert "Traceback" not in outputs[node[0]] and "frame #" not in outputs[node[0]], outputs[node[0]]
    # Node 1's folder as a scheduler that killed its watch with the job would leave it (no end written): its ranks'
    # own records are read, and rank 0, of the other node, is named as having left none here.
    (tmp_path / f"node{node[1]}" / "watch.json").unlink()
    rc, output, explained = explain(tmp_path / f"node{node[1]}", tmp_path)
    assert rc == 1 and explained is not None and explained["ranks_without_records"] == [0], output
