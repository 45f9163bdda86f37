"""Every rank training on the same batches, under FSDP2, `replicate` and HSDP: `identical-inputs-across-ranks`,
decided by the same rule as DDP's (`analyze/agreement.same_inputs`) from the fingerprints of each observed step's
training inputs (the root module's forwards in grad mode), compared across ranks in one fixed-shape collective.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo (`--mistake same-data`: every rank seeds its batch generator
with 0 instead of its rank): exit code 0 every time, nothing said. tests/scripts/fsdp2_train.py, 2 ranks: the first
batch sums 6.712465 on both ranks (-8.461437 on rank 1 in the clean run), and the head ends at -2.214720 on both,
exactly where one rank alone would take it. tests/scripts/replicate_train.py, 2 ranks: head -2.214720 on both.
tests/scripts/fsdp2_hsdp.py, 4 ranks on a [2, 2] mesh: head -0.439648 on all four. The job runs at the speed of
one rank with the cost of all of them.

Not covered (the same as DDP's rule): ranks that share batches in some pairs only (an HSDP job seeding by the shard
index alone): the finding needs every rank alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check


@pytest.mark.parametrize(
    "script, ranks, parallelism",
    [("fsdp2_train.py", 2, "fsdp2"), ("replicate_train.py", 2, "replicate"), ("fsdp2_hsdp.py", 4, "fsdp2")],
)
def test_every_rank_training_on_the_same_batches_is_named(tmp_path: Path, script, ranks, parallelism) -> None:
    args = ["--nproc-per-node", str(ranks), "--no-verify", str(SCRIPTS / script), "--mistake", "same-data"]
    run = check(args, tmp_path, timeout=240)
    assert run.rc == 0 and run.codes == {"identical-inputs-across-ranks"}, run.output
    f = run.finding("identical-inputs-across-ranks")
    assert f["severity"] == "warning" and f["ranks"] == list(range(ranks)), f
    compared = run.report["compared"]
    assert run.report["parallelism"] == parallelism and compared["inputs"] == len(f["steps"]) > 0, compared
    # The first observed step's forward comes before the model is found (at its first optimizer step).
    assert f["steps"][0] >= 1 and f["measured"][0]["value"] == len(f["steps"]), f


def test_ranks_on_their_own_batches_are_compared_and_clean(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", "--no-verify", str(SCRIPTS / "replicate_train.py")], tmp_path, timeout=240)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    assert run.report["compared"]["inputs"] >= 7, run.report["compared"]  # 8 observed steps, less the first
