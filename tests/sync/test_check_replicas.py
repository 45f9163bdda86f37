"""The replicas of a model FSDP2 replicates hold the same weights: `replicate` (every rank holds every parameter) and
HSDP (`fully_shard` on a [replicate, shard] mesh: the ranks along the replicate dimension hold the same shard),
compared after the first observed step and after the last, and named at the first step whose copies differ
(`exchange/sharded_replicas.py`).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo; every run ends with exit code 0 and nothing said:
- tests/scripts/replicate_train.py, 2 ranks, 12 steps. `--mistake seed-rank` (the model built after
  `torch.manual_seed(rank)`): replicate does not broadcast rank 0's weights as DDP does, and the head's weight sums
  end at -1.622510 on rank 0 and -0.726573 on rank 1. `--mistake clamp-rank0` (rank 0 alone clamps the head's
  weights after each step): -1.715326 and -1.545847. `none`: -1.496532 on both.
- tests/scripts/fsdp2_hsdp.py, 4 ranks on a [2, 2] mesh, 10 steps. `--mistake seed-rank`: the head sums -0.614580
  on ranks 0 and 1, 0.947887 on ranks 2 and 3, and the shards of the first bias differ between the replicas (rank 0
  -0.667085, rank 2 -0.722629). `--drift-at 3` (rank 1 alone adds 0.01 to its shard of the first bias after step 3):
  rank 1's shard ends at -0.856032, its replica's (rank 3) at -1.015936. `none`: every pair equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

REPLICATE = str(SCRIPTS / "replicate_train.py")
HSDP = str(SCRIPTS / "fsdp2_hsdp.py")
ALL_SIX = {"blocks.0.0.weight", "blocks.0.0.bias", "blocks.1.0.weight", "blocks.1.0.bias", "head.weight", "head.bias"}


def _check(tmp_path: Path, ranks: int, script: str, *args: str):
    return check(["--nproc-per-node", str(ranks), "--no-verify", script, *args], tmp_path, timeout=240)


def test_replicate_replicas_seeded_apart_differ_from_the_first_step(tmp_path: Path) -> None:
    run = _check(tmp_path, 2, REPLICATE, "--mistake", "seed-rank")
    assert run.rc == 1 and run.codes == {"replica-divergence"}, run.output
    f = run.finding("replica-divergence")
    assert (f["severity"], f["ranks"], f["steps"]) == ("error", [0, 1], [0]), f
    assert run.params("replica-divergence") == ALL_SIX
    assert "manual_seed" in f["fix"] and "dist.broadcast" in f["fix"], f


def test_replicate_weights_clamped_on_rank_0_alone_part_after_the_first_step(tmp_path: Path) -> None:
    run = _check(tmp_path, 2, REPLICATE, "--mistake", "clamp-rank0")
    assert run.rc == 1 and run.codes == {"replica-divergence"}, run.output
    f = run.finding("replica-divergence")
    # the clamp follows every step, the first too, after its optimizer step: the copies agree at the first step's
    # end and differ from the second's on
    assert (f["severity"], f["ranks"], f["steps"]) == ("error", [0, 1], [1]), f
    assert run.params("replica-divergence") == {"head.weight"}


def test_replicate_replicas_parted_by_a_learning_rate_apart_are_put_under_that_cause(tmp_path: Path) -> None:
    """tests/scripts/replicate_train.py --mistake lr-rank0: rank 0's AdamW at twice the others' learning rate,
    every rank seeded alike. Plain torchrun: exit 0, nothing said, head.weight sums -1.833269 on rank 0 and -1.268686
    on rank 1 after 12 steps. The replicas part at the first step, when they are first compared; the cause is the
    learning rate, not weights that started apart (the check once said to seed alike)."""
    run = _check(tmp_path, 2, REPLICATE, "--mistake", "lr-rank0")
    assert run.rc == 1 and run.codes == {"optimizer-differs", "replica-divergence"}, run.output
    f = run.finding("replica-divergence")
    assert (f["severity"], f["ranks"], f["steps"], f["caused_by"]) == ("error", [0, 1], [0], ["optimizer-differs"]), f
    assert run.params("replica-divergence") == ALL_SIX
    assert "manual_seed" not in f["fix"] and "optimizer-differs" in f["fix"], f  # its cause's fix, not a seed


def test_clean_replicate_replicas_are_compared_and_counted(tmp_path: Path) -> None:
    run = _check(tmp_path, 2, REPLICATE)
    assert run.rc == 0 and run.codes == set(), run.output
    compared = run.report["compared"]
    assert (compared["replicas"], compared["replica_rows"]) == (6, 1), compared


@pytest.mark.parametrize(
    ("args", "step", "ranks"),
    [
        (["--mistake", "seed-rank"], 0, [0, 2]),  # every shard differs; the first row (shard 0): ranks 0 and 2
        # rank 1's shard of the first bias, against its replica on rank 3: written after step 3's optimizer step,
        # so the copies agree at step 3's end and differ at step 4's (not only at the last observed step, 7)
        (["--drift-at", "3"], 4, [1, 3]),
    ],
)
def test_hsdp_replicas_that_differ_are_named_by_the_ranks_holding_the_shard(
    tmp_path: Path, args: list[str], step: int, ranks: list[int]
) -> None:
    run = _check(tmp_path, 4, HSDP, *args)
    assert run.rc == 1 and run.codes == {"replica-divergence"}, run.output
    f = run.finding("replica-divergence")
    assert (f["severity"], f["ranks"], f["steps"]) == ("error", ranks, [step]), f
    if args[0] == "--drift-at":
        assert run.params("replica-divergence") == {"0.bias"}


def test_clean_hsdp_replicas_are_compared_among_the_ranks_holding_each_shard(tmp_path: Path) -> None:
    run = _check(tmp_path, 4, HSDP)
    assert run.rc == 0 and run.codes == set(), run.output
    compared = run.report["compared"]
    assert (compared["replicas"], compared["replica_rows"]) == (6, 2), compared
