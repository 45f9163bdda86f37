"""`ddp-doctor check` on unmodified scripts whose replicas diverge (or whose gradients are reduced twice): the
cause's code, on default flags, naming the rank, the step and the line, with nothing else at warning or error
than `replica-divergence` pointing to it."""

from __future__ import annotations

import pytest
from checkrun import SCRIPTS, check, line_of

PLATEAU = f"cause_plateau_local.py:{line_of(SCRIPTS / 'cause_plateau_local.py', 'sched.step(')}"


@pytest.mark.parametrize(
    "script, nproc, code, ranks, steps, where",
    [
        ("cause_scheduler_rank0.py", 2, "optimizer-differs", [0, 1], [1], "cause_scheduler_rank0.py:27"),
        ("cause_plateau_local.py", 2, "optimizer-differs", [0, 1], [3], PLATEAU),
        ("cause_skip_step.py", 4, "optimizer-step-skipped", [1], [2], None),
        ("cause_reduce_twice.py", 2, "grads-reduced-twice", [0, 1], list(range(8)), "cause_reduce_twice.py:24"),
        ("cause_init_sync_false.py", 2, "replicas-differ-at-wrap", [0, 1], [0], None),
        ("cause_rank0_load.py", 2, "weights-changed-outside-optimizer", [0], [0], "cause_rank0_load.py:18"),
    ],
)
def test_check_names_the_cause(tmp_path, script, nproc, code, ranks, steps, where) -> None:
    run = check(["--nproc-per-node", str(nproc), str(SCRIPTS / script)], tmp_path)
    assert run.rc == 1, run.output
    finding = run.finding(code)
    assert (finding["ranks"], finding["steps"]) == (ranks, steps), finding
    if where:
        assert where in finding["detail"] + finding["fix"] + finding["title"], finding
    if script == "cause_scheduler_rank0.py":  # rank 0's scheduler alone: the rates the ranks held at that step
        measured = {m["name"]: m["value"] for m in finding["measured"]}
        assert measured == {"group 0 lr (rank 0)": pytest.approx(0.05), "group 0 lr (rank 1)": pytest.approx(0.1)}
    if code == "replicas-differ-at-wrap":
        assert (
            "DDP was built with init_sync=False" in finding["detail"] and run.report["ddp_config"]["init_sync"] is False
        )
    loud = {f["code"] for f in run.report["findings"] if f["severity"] in ("error", "warning")}
    if code == "grads-reduced-twice":
        assert loud == {code}, run.output
    else:
        assert loud == {code, "replica-divergence"}, run.output
        assert f"fix the cause: {code}" in run.finding("replica-divergence")["fix"]
    assert "collective-mismatch" not in run.codes


def test_a_plateau_scheduler_given_a_metric_reduced_across_the_ranks_is_clean(tmp_path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "cause_plateau_local.py"), "--reduced"], tmp_path)
    assert run.rc == 0 and run.codes == set(), run.output


def test_zero_redundancy_optimizer_shards_are_not_optimizer_differs(tmp_path) -> None:
    # Each rank's inner optimizer holds its own shard (different param groups by design), stepped with a scheduler.
    run = check(["--nproc-per-node", "4", str(SCRIPTS / "zero_sharded.py")], tmp_path)
    # Four ranks on two cores: a timing finding is a measurement of the machine, not this test's subject (each
    # rank steps a shard of its own size, and a loaded machine once made one rank 1.7x slower in its optimizer).
    assert not run.codes - {"input-bound", "straggler-rank"} and (run.rc == 0 or run.codes), run.output
    assert run.report["recommendation"]["verified"], run.report["recommendation"]


@pytest.mark.parametrize(
    "flag, rank, steps, statement", [("--extra-pass", 1, [2], "ddp(x).pow(2)"), ("--accumulate", 0, [0, 1, 2, 3], None)]
)
def test_an_extra_synced_pass_on_one_rank_is_a_collective_mismatch_not_a_skipped_step(
    tmp_path, flag, rank, steps, statement
) -> None:
    """tests/scripts/cause_skip_step.py on 4 ranks. `--extra-pass`: rank 1 runs a second backward in step 2 (an
    auxiliary objective, for its logs) and then steps. `--accumulate`: rank 0 accumulates two micro-batches per step
    with sync on for both, the others one. Ground truth under plain torchrun, both: exit code 1 (after 14 s), the
    rank with the extra all-reduce fails at the end (*Connection closed by peer*: it waits for ranks that finished),
    and torchrun names that rank's failure. Before, the check called both `optimizer-step-skipped` ("the script
    skipped it") with the fix to all-reduce a skip flag: counted by synced passes, an extra pass looks like a step
    without an update. The extra pass ran at a line where no step begins, or in every step: not a skip."""
    run = check(["--nproc-per-node", "4", str(SCRIPTS / "cause_skip_step.py"), flag], tmp_path)
    assert run.rc == 1, run.output
    first = run.report["findings"][0]
    assert (first["code"], first["ranks"], first["steps"]) == ("collective-mismatch", [rank], steps), first
    if statement:
        line = line_of(SCRIPTS / "cause_skip_step.py", statement)
        assert first["sites"] == [f"tests/scripts/cause_skip_step.py:{line}"], first
    assert "optimizer-step-skipped" not in run.codes, run.output
    assert run.finding("replica-divergence")["caused_by"] == ["collective-mismatch"]
