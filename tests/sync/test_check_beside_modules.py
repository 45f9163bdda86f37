"""Modules the script runs beside the DDP model (tests/scripts/beside_modules.py, 2 ranks: a DDP student trained
toward a frozen teacher called outside DDP).

Ground truth under plain torchrun (torch 2.13.0, gloo, 10 SGD steps; every case exit code 0, nothing said): same
(one seed for the teacher on every rank): the teachers' parameter sums agree (2.6715 on both). rank-seed (the
teacher built after `torch.manual_seed(rank + 1)`): 2.6715 on rank 0, -2.1133 on rank 1, so each rank distils from
a different function while DDP keeps the students equal (-2.7922 on both, where the same teacher gives -2.2509).
rank0-load (a checkpoint loaded into the teacher on rank 0 only): 4.0072 against 2.6715. broadcast (rank-seed, then
rank 0's teacher broadcast: the fix) and ema (an EMA of the student, `AveragedModel`, updated and run after each
step): equal everywhere, and the students end as in `same`.

Before, the check compared the DDP model alone and said nothing of the teacher in any case.

rank-seed-slot (rank-seed, and a parameter attached to the student after the wrap, all ones on every rank and used by
no forward): its sums agree (3.0 on both ranks) while the teachers differ as in rank-seed. The ranks compare one
digest of everything their trees hold beyond DDP's lists, the teacher included, and the check read "the digest
differs" as "these parameters differ": `unregistered-parameters` at error, "They already differ across ranks at step
0". rank-seed-slot-apart (the parameter filled with rank + 1: sums 3.0 and 6.0): both differ, and the digest cannot
say which parted first. rank-seed-eval (rank-seed, and rank 0 alone puts the student in eval mode from step 4):
exit 0, nothing said by torch; the check compared the modes at the digest's first differing step only (step 0,
where the teacher parted) and said nothing of the modes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkrun import REPO, SCRIPTS, check, line_of
from frameworkrun import torchrun

SCRIPT = str(SCRIPTS / "beside_modules.py")


def _check(tmp_path: Path, case: str):
    return check(["--nproc-per-node", "2", SCRIPT, str(tmp_path / "out"), "--case", case], tmp_path)


def _teachers(tmp_path: Path, case: str, key: str = "teacher") -> list[float]:
    out = tmp_path / case
    done = torchrun("beside_modules.py", [str(out), "--case", case], REPO, timeout=120)
    assert done.rc == 0 or done.aborted_at_exit, done.output[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text())[key] for r in (0, 1)]


@pytest.mark.parametrize("case", ["rank-seed", "rank0-load"])
def test_a_teacher_that_differs_across_ranks_is_named_at_the_line_that_calls_it(tmp_path: Path, case: str) -> None:
    a, b = _teachers(tmp_path, case)
    assert abs(a - b) > 0.1, (a, b)
    run = _check(tmp_path / "check", case)
    assert run.rc == 1, run.output
    found = run.finding("replica-divergence")
    assert found["severity"] == "error" and found["ranks"] == [0, 1] and found["steps"] == [0], found
    assert [p["name"] for p in found["params"]] == ["teacher"] and found["params"][0]["numel"] == 212, found
    assert found["sites"] == [f"tests/scripts/beside_modules.py:{line_of(SCRIPT, 'target = teacher(x)')}"], found
    assert {m["name"]: m["value"] for m in found["measured"]} == {"modules_apart": 1}, found
    assert run.report["compared"]["modules_beside"] == 1


@pytest.mark.parametrize(("case", "beside"), [("same", 1), ("broadcast", 1), ("ema", 2)])
def test_modules_beside_the_model_that_agree_are_compared_and_clean(tmp_path: Path, case: str, beside: int) -> None:
    if case == "broadcast":
        a, b = _teachers(tmp_path, case)
        assert a == b, (a, b)
    run = _check(tmp_path / "check", case)
    assert run.rc == 0 and run.codes == set(), run.output
    assert run.report["compared"]["modules_beside"] == beside, run.report["compared"]


@pytest.mark.parametrize(("case", "apart"), [("rank-seed-slot", False), ("rank-seed-slot-apart", True)])
def test_a_teacher_apart_is_not_taken_for_parameters_added_after_the_wrap_apart(
    tmp_path: Path, case: str, apart: bool
) -> None:
    a, b = _teachers(tmp_path, case, "slot")
    assert (a != b) == apart, (a, b)
    run = _check(tmp_path / "check", case)
    assert run.rc == 1, run.output
    teacher = run.finding("replica-divergence")
    assert [p["name"] for p in teacher["params"]] == ["teacher"] and teacher["severity"] == "error", teacher
    slot = run.finding("unregistered-parameters")
    assert [p["name"] for p in slot["params"]] == ["0.slot"], slot
    if apart:  # both parts of the digest differ: the step the parameter parted is not claimed, the last one is
        assert slot["severity"] == "error" and slot["steps"] == [0, 7] and teacher["steps"] == [7], (slot, teacher)
    else:  # the teacher alone differs: its first step is the digest's
        assert slot["severity"] == "warning" and slot["steps"] == [0] and teacher["steps"] == [0], (slot, teacher)


def test_modes_that_part_after_a_teacher_already_differs_are_named_at_their_own_step(tmp_path: Path) -> None:
    run = _check(tmp_path, "rank-seed-eval")
    assert run.rc == 1, run.output
    apart = {
        tuple(p["name"] for p in f["params"]): f for f in run.report["findings"] if f["code"] == "replica-divergence"
    }
    assert apart.keys() == {("teacher",), ()}, apart
    assert apart[("teacher",)]["steps"] == [0] and apart[("teacher",)]["severity"] == "error", apart
    assert apart[()]["steps"] == [4] and apart[()]["severity"] == "warning" and apart[()]["ranks"] == [0, 1], apart
