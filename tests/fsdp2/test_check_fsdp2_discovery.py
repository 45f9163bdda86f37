"""Which model `ddp-doctor check` follows in an FSDP2 job: the one the optimizer trains, wherever it is held.

A job trained by a class (tests/scripts/fsdp2_class_loop.py): the loop's frames hold the trainer (`self`), and only
`self.model` reaches the model, so the check finds the sharded model among every module of the process.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 steps; every run ends with exit code 0 and prints
nothing but its own line per rank:
- none: the head's weight sums are equal (0.152787 on both ranks), largest change 0.015050.
- root-unsharded: the head trains apart on each rank, sums 0.167875 and 0.137709.
- optimizer-before: no weight changes (largest change 0.000000 on both ranks).
Before the check looked past the frames, it took each of these jobs for one that built no DDP model: the clean one
was "No problems found" with the advice to wrap the model in DDP, the root-unsharded one `model-not-wrapped` on
`param[0]` and `param[1]` with the fix "wrap the model in DistributedDataParallel", and on one rank the check
ended with the error that the script built no DDP model.

Distillation (tests/scripts/fsdp2_distill.py): a frozen teacher of 4 sharded blocks beside a student of 2, the
optimizer stepping the student. Plain torchrun: exit code 0, the student's head sums 0.011364 on both ranks. The
check followed the model with the most sharded modules, the teacher, and said `optimizer-params-replaced`: "the
optimizer steps 6 parameters that are no longer the model's".

Compiled (tests/scripts/fsdp2_compiled.py, `torch.compile(model, backend="eager")` after sharding): plain torchrun,
exit code 0; the head's weight sums 1.139284 on both ranks, and with the root left unsharded 0.563016 and 1.261763.
The check named the unsharded head `_orig_mod.2.weight`, and would have called a sharded root unsharded (its
module is `_orig_mod` under the compiled wrapper).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

SCRIPT = str(SCRIPTS / "fsdp2_class_loop.py")


def _check(tmp_path: Path, mistake: str, ranks: int = 2):
    args = ["--nproc-per-node", str(ranks), "--no-verify", "--steps", "4", SCRIPT, "--mistake", mistake]
    return check(args, tmp_path, timeout=180)


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_clean_fsdp2_job_trained_by_a_class_is_clean_and_named_fsdp2(tmp_path: Path, ranks: int) -> None:
    run = _check(tmp_path, "none", ranks)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    assert run.report["parallelism"] == "fsdp2" and run.report["sharding"]["sharded_modules"] == 3
    assert "DistributedDataParallel" not in run.output


def test_its_root_left_unsharded_is_named_with_the_heads_names(tmp_path: Path) -> None:
    run = _check(tmp_path, "root-unsharded")
    assert run.rc == 1 and run.codes == {"unsharded-params-not-synced"}, run.output
    assert run.params("unsharded-params-not-synced") == {"2.weight", "2.bias"}
    assert "fully_shard the root" in run.finding("unsharded-params-not-synced")["fix"]


def test_its_optimizer_built_before_fully_shard_is_named_with_its_line(tmp_path: Path) -> None:
    run = _check(tmp_path, "optimizer-before")
    assert run.rc == 1 and run.codes == {"optimizer-params-replaced"}, run.output
    assert "SGD created at tests/scripts/fsdp2_class_loop.py:26" in run.finding("optimizer-params-replaced")["detail"]


def test_a_distillation_job_follows_the_student_the_optimizer_trains_not_the_bigger_teacher(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "2", "--no-verify", "--steps", "4", str(SCRIPTS / "fsdp2_distill.py")]
    run = check(args, tmp_path, timeout=180)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    assert run.report["sharding"]["sharded_modules"] == 3  # the student: 2 blocks and its root


@pytest.mark.parametrize("root_unsharded", [False, True])
def test_a_compiled_sharded_model_is_named_in_the_users_words(tmp_path: Path, root_unsharded: bool) -> None:
    script = [str(SCRIPTS / "fsdp2_compiled.py"), *(["--root-unsharded"] if root_unsharded else [])]
    run = check(["--nproc-per-node", "2", "--no-verify", "--steps", "4", *script], tmp_path, timeout=180)
    assert run.report["sharding"]["root_sharded"] is not root_unsharded, run.output
    if root_unsharded:
        assert run.rc == 1 and run.codes == {"unsharded-params-not-synced"}, run.output
        assert run.params("unsharded-params-not-synced") == {"2.weight", "2.bias"}
    else:
        assert run.rc == 0 and run.report["findings"] == [], run.output
