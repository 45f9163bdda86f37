"""A freeze decided per rank before the wrap, in a way whose trainable shapes line up on every rank
(tests/scripts/frozen_apart.py, 2 ranks): DDP's constructor compares shapes only and accepts the model.

Ground truth under plain torchrun (torch 2.13.0, gloo, 12 SGD steps): `apart` (rank 0 freezes the first Linear(8, 8),
rank 1 the second) exits 0 with the two blocks 0.0157 (weights) and 0.0327 (biases) apart and the head equal; the
first block's gap on one rank equals the second's on the other: DDP averaged rank 0's gradient of the second block
with rank 1's gradient of the first, bucket slot by slot. `same` (every rank freezes the first Linear): exit 0,
every parameter 0.0 apart. Before, the check said `unfrozen-after-wrap` for the first block ("requires_grad was set
to True after DDP was built") and `frozen-after-wrap` for the second, neither of which the script does, and
recommended find_unused_parameters=True, which changes nothing here.
"""

from __future__ import annotations

from pathlib import Path

from checkrun import SCRIPTS, check, line_of

SCRIPT = str(SCRIPTS / "frozen_apart.py")


def test_a_freeze_decided_per_rank_before_the_wrap_is_named_as_such_and_the_same_freeze_is_clean(
    tmp_path: Path,
) -> None:
    run = check(["--nproc-per-node", "2", SCRIPT, str(tmp_path / "apart-out"), "--case", "apart"], tmp_path / "a")
    found = run.finding("param-shapes-differ")
    assert found["severity"] == "error" and found["ranks"] == [0, 1] and found["steps"] == [], found
    assert run.params("param-shapes-differ") == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert found["sites"] == [f"tests/scripts/frozen_apart.py:{line_of(SCRIPT, 'ddp = DistributedDataParallel')}"]
    assert not run.codes & {"frozen-after-wrap", "unfrozen-after-wrap"}, run.output  # it froze before the wrap
    assert run.finding("replica-divergence")["caused_by"] == ["param-shapes-differ"]
    assert run.report["recommendation"]["flags_known"] is False, run.report["recommendation"]
    assert run.rc == 1
    same = check(["--nproc-per-node", "2", SCRIPT, str(tmp_path / "same-out"), "--case", "same"], tmp_path / "s")
    assert same.rc == 0 and same.codes == set(), same.output


def test_fsdp2_parameters_frozen_per_rank_are_named_and_the_same_freeze_is_clean(tmp_path: Path) -> None:
    """tests/scripts/fsdp2_frozen_apart.py (FSDP2 on each Linear and the root; rank 0 freezes the first Linear(8, 8),
    rank 1 the second). Plain torchrun: exit 0 after 12 steps, nothing said; both blocks moved (each rank's shard of
    the block it trains) and the gathered first block sums to -1.26177, against -1.34581 when every rank freezes it
    (`same`, exit 0) and -1.36232 when every rank freezes the second instead: the reduce-scatters of two groups of
    the same size paired up across the ranks. Before, the check said "No problems found" and claimed to have compared
    "the optimizer's parameters against the model's 4 trainable parameters" (rank 0's)."""
    script = str(SCRIPTS / "fsdp2_frozen_apart.py")
    run = check(["--nproc-per-node", "2", script, "--case", "apart"], tmp_path / "a")
    found = run.finding("param-shapes-differ")
    assert (found["severity"], found["ranks"], found["steps"]) == ("error", [0, 1], [0]), found
    assert run.params("param-shapes-differ") == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {p["numel"] for p in found["params"]} == {64, 8}, found["params"]
    assert "replica-divergence" not in run.codes, run.output  # the modules' modes agree
    assert run.rc == 1
    same = check(["--nproc-per-node", "2", script, "--case", "same"], tmp_path / "s")
    assert same.rc == 0 and same.errors() == [], same.output
