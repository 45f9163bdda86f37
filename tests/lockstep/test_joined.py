"""Uneven inputs that the script handles with `Join` (tests/scripts/joined.py: rank r has 5 + 3 r batches per epoch,
2 epochs, the loop inside `Join([model])` or `model.join()`).

Ground truth under plain torchrun (torch 2.13.0, gloo, 2 ranks): exit 0 and the weights equal on both ranks
(gap 0.000e+00), with a DataLoader or a list of batches, either API: rank 0 runs out after 5 batches and shadows
rank 1's collectives (the "not joined yet" all-reduce of each forward, DDP's gradient buckets) until rank 1 joins.

Before, `check` hung there: rank 1 reached its 8 observed steps inside the Join and started the check's exchange,
which met rank 0's shadowing all-reduce; after the group's timeout the report led with a `collective-mismatch`
blaming the Join's own all-reduce. With 12 and 15 batches (the 8 steps reached before anyone joined) it said
`uneven-inputs` (error: "the job hangs or crashes at the end of the epoch") with Join as the fix, which the script
already uses. Now the report is made where the Join ends, on every rank, and the uneven inputs are an info.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check
from watchrun import watch

SCRIPT = str(SCRIPTS / "joined.py")


@pytest.mark.parametrize("batches, observed", [(5, 5), (12, 8)])
def test_uneven_inputs_inside_join_are_reported_where_the_join_ends_as_an_info(
    tmp_path: Path, batches: int, observed: int
) -> None:
    run = check(["--nproc-per-node", "2", "--timeout", "100", SCRIPT, "--batches", str(batches)], tmp_path, timeout=150)
    assert run.rc == 0, run.output
    assert [(f["code"], f["severity"]) for f in run.report["findings"]] == [("uneven-inputs", "info")], run.output
    found = run.finding("uneven-inputs")
    assert found["ranks"] == [0, 1] and found["steps"] == [batches], found
    assert found["measured"][0]["name"] == "epoch_ends_after_batches" and found["measured"][0]["value"] > batches
    assert run.report["steps_observed"] == observed, run.output
    assert run.report["recommendation"]["verified"] is True, run.output


@pytest.mark.parametrize("api", ["join", "model-join"])
def test_a_list_of_batches_inside_join_is_clean(tmp_path: Path, api: str) -> None:
    """No DataLoader: no batch counts per rank to compare, and nothing wrong with the job."""
    run = check(
        ["--nproc-per-node", "2", "--timeout", "100", SCRIPT, "--api", api, "--loader", "list"], tmp_path, timeout=150
    )
    assert run.rc == 0 and run.codes == set(), run.output
    assert run.report["steps_observed"] == 5, run.output


def test_watch_runs_a_joined_job_to_its_end(tmp_path: Path) -> None:
    """Under `watch`, the report comes where the first Join ends, and the job trains on to its end: rank 1's 16
    steps, the weights equal (the script's own check, printed by rank 0)."""
    run = watch(["--nproc-per-node", "2", SCRIPT], tmp_path)
    assert run.rc == 0, run.output
    assert "weights gap 0.000e+00" in run.output, run.output
    assert [(f["code"], f["severity"]) for f in run.report["findings"]] == [("uneven-inputs", "info")], run.output
    ended = run.ended
    assert ended["failed"] is False and ended["steps"] == 16, ended


def test_a_join_that_throws_when_a_rank_runs_out_is_an_info_too(tmp_path: Path) -> None:
    """`Join(..., throw_on_early_termination=True)`, the script catching the Join's error around each epoch (plain
    torchrun: exit 0, weights equal, every rank trains as many batches as the rank with the fewest). Before, the
    forward that raised the Join's error on rank 1 counted as a forward with no backward: a `collective-mismatch`
    warning for an evaluation that never happened, and the report said the rank that ran out shadows the others.
    With 5 and 8 batches the observed steps end in the second epoch's Join, whose throw makes the report."""
    batches = 5
    run = check(
        ["--nproc-per-node", "2", "--timeout", "100", SCRIPT, "--batches", str(batches), "--throw"],
        tmp_path,
        timeout=150,
    )
    assert run.rc == 0, run.output
    assert [(f["code"], f["severity"]) for f in run.report["findings"]] == [("uneven-inputs", "info")], run.output
    found = run.finding("uneven-inputs")
    assert found["steps"] == [batches] and found["sites"] == [_join_line()], found
    measured = {m["name"]: m["value"] for m in found["measured"]}
    assert measured == {"epoch_ends_after_batches": batches, "batches_most": 8, "batches_fewest": batches}, found
    assert run.report["steps_observed"] == 8, run.output


def test_watch_runs_a_job_whose_join_throws_to_its_end(tmp_path: Path) -> None:
    """Every rank trains 5 batches in each of the 2 epochs (the Join ends each epoch when rank 0 runs out)."""
    run = watch(["--nproc-per-node", "2", "--steps", "4", SCRIPT, "--throw"], tmp_path)
    assert run.rc == 0, run.output
    assert "weights gap 0.000e+00" in run.output, run.output
    assert [f["code"] for f in run.report["findings"]] == ["uneven-inputs"], run.output
    ended = run.ended
    assert ended["failed"] is False and ended["steps"] == 10, ended


def _join_line() -> str:
    lines = Path(SCRIPT).read_text().splitlines()
    return f"tests/scripts/joined.py:{next(i for i, line in enumerate(lines, 1) if 'with Join(' in line)}"
