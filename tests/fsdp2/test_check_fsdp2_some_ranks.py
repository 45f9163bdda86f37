"""`ddp-doctor check` on FSDP2 jobs where some ranks do alone what every rank must do (tests/scripts/fsdp2_train.py):
save the sharded state dict, gather a full one, run a forward or a training pass, call a collective.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 optimizer steps of two micro-batches:
- --save rank0 (rank 0 alone: `torch.save(model.state_dict(), path)` after the third step): exit code 0, the head's
  weight sums as without it; the file holds DTensors with rank 0's shard (blocks.0.0.weight: a local [32, 16] of a [64, 16] weight), and
  `model.load_state_dict(torch.load(path, weights_only=False))` on the unsharded Net raises RuntimeError
  "aten.copy_.default got mixed torch.Tensor and DTensor". --save every-same: every rank writes the one file
  (whichever writes last wins). --save dcp (torch.distributed.checkpoint.save) and --save full (a full state dict
  gathered on every rank, written by rank 0) hold the whole model.
- A full state dict gathered on rank 0 alone (`get_model_state_dict(..., full_state_dict=True)` under
  `if rank == 0`) does not end quietly: rank 0's all-gathers meet rank 1's next forward, gloo aborts rank 1
  ("Received data size doesn't match expected size. Is there a distributed collective mismatch"), with NCCL the
  same mismatch hangs until the group timeout.
- eval-rank0 (rank 0 alone runs a forward under no_grad after the third step): gloo aborts rank 0 (*Received data
  size doesn't match expected size*: its all-gathers met rank 1's next training forward, of other sizes) and rank 1
  loses its peer; exit code 1. On a two-layer model whose groups have the sizes of the training forward's, the same
  evaluation returned on rank 0 (with rank 1's all-gathers) and both ranks hung until killed. eval-every (every
  rank evaluates): exit code 0.
- log-rank0 (rank 0 alone all_reduces the loss to log it, after the third step): the job hangs, silently (killed
  after 100 s; gloo's default timeout is 30 minutes): rank 0 waits in its all_reduce, rank 1 in its next forward's
  all-gathers. log-every (every rank all_reduces it, rank 0 prints it): exit code 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import check
from fsdp2train import SCRIPT, line_of


@pytest.mark.parametrize(
    "save, kind", [("rank0", "some-ranks"), ("every-same", "one-path")], ids=["rank0", "every-same"]
)
def test_a_checkpoint_of_some_ranks_shards_is_named_with_its_line(tmp_path: Path, save: str, kind: str) -> None:
    run = check(["--nproc-per-node", "2", SCRIPT, "--save", save, "--save-dir", str(tmp_path)], tmp_path, timeout=180)
    assert run.rc == 1 and run.codes == {"sharded-checkpoint-incomplete"}, run.output
    finding = run.finding("sharded-checkpoint-incomplete")
    assert finding["severity"] == "error" and finding["ranks"] == ([0] if save == "rank0" else [0, 1])
    assert finding["sites"] == [f"tests/scripts/{line_of('torch.save(model.state_dict(), path)')}"]
    assert finding["labels"] == {
        "kind": kind,
        "file": str(tmp_path / "ck.pt"),
        "example": "blocks.0.0.weight",
        "local_shape": "32x16",
        "global_shape": "64x16",
        "saves_checked": "observed-steps",
    }
    saving = {"saving_ranks": 1} if save == "rank0" else {}
    assert {m["name"]: m["value"] for m in finding["measured"]} == {"sharded_tensors": 6, **saving}
    assert "torch.distributed.checkpoint.save" in finding["fix"] and "full_state_dict=True" in finding["fix"]


@pytest.mark.parametrize(
    "save, call, line",
    [
        ("gather-rank0", "get_model_state_dict", line_of("state = get_model_state_dict(")),
        ("tensor-rank0", "full_tensor", line_of("items()}, path)")),
    ],
    ids=["gather-rank0", "tensor-rank0"],
)
def test_a_full_state_dict_gathered_on_rank_0_alone_is_named_with_its_line(tmp_path: Path, save, call, line) -> None:
    """`get_model_state_dict(..., full_state_dict=True)`, or `.full_tensor()` of each value of the sharded state
    dict, under `if rank == 0` (ground truth, plain torchrun, torch 2.13.0, gloo, 2 ranks, both: gloo aborts rank 1
    at its next forward, *Received data size doesn't match expected size*). The report is an FSDP2 failure report,
    not "the script failed before it built a DDP model".

    In CI (2026-11-26, loaded) the first version failed: the watchdog's last sample of rank 0 was 1.3 s old and
    showed the backward before the gather, so only `rank-crashed` was reported. The gather is now counted by line
    before its collective starts (launch/plain_steps.py); this ran 4 times at once here, all 4 named it."""
    run = check(["--nproc-per-node", "2", SCRIPT, "--save", save, "--save-dir", str(tmp_path)], tmp_path)
    assert run.rc == 1 and run.report is not None, run.output
    assert run.report["parallelism"] == "fsdp2" and run.report["sharding"]["sharded_modules"] == 3
    assert run.report["backend"] == "gloo" and run.report["torch_version"].startswith("2.")
    finding = run.finding("state-gather-some-ranks")
    assert (finding["ranks"], finding["steps"], finding["sites"]) == ([0, 1], [3], [f"tests/scripts/{line}"])
    assert (finding["labels"]["call"], finding["labels"]["ranks_alone"]) == (call, "0"), finding
    assert finding["labels"]["site"].startswith(f"tests/scripts/{line}"), finding
    # What the mismatch did to rank 1 is shown under the cause; nothing else is reported.
    assert run.codes <= {"state-gather-some-ranks", "rank-crashed"}, run.output
    crashed = [f for f in run.report["findings"] if f["code"] == "rank-crashed"]
    assert all(f["caused_by"] == ["state-gather-some-ranks"] for f in crashed), crashed
    assert finding["explains"] == (["rank-crashed"] if crashed else [])
    assert "FSDP2" in run.report["recommendation"]["reason"]


def test_a_forward_through_the_sharded_model_on_rank_0_alone_is_named_with_its_line(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", "--timeout", "40", SCRIPT, "--mistake", "eval-rank0"], tmp_path)
    assert run.rc == 1 and run.report is not None and run.report["parallelism"] == "fsdp2", run.output
    finding = run.finding("sharded-forward-some-ranks")
    assert (finding["ranks"], finding["steps"]) == ([0, 1], [3])
    assert finding["sites"] == [f"tests/scripts/{line_of('model(torch.randn(4, 16')}"], finding
    assert finding["labels"] == {"kind": "forward", "ranks_alone": "0"}
    assert [(m["name"], m["value"]) for m in finding["measured"]] == [("forwards_alone", 1)]
    assert run.codes <= {"sharded-forward-some-ranks", "rank-crashed"}, run.output
    crashed = [f for f in run.report["findings"] if f["code"] == "rank-crashed"]
    assert all(f["caused_by"] == ["sharded-forward-some-ranks"] for f in crashed), crashed
    assert finding["explains"] == (["rank-crashed"] if crashed else [])  # a crash that is reported is under it


def test_a_training_pass_on_one_rank_alone_is_named_at_its_step_as_a_training_pass(tmp_path: Path) -> None:
    """`--mistake aux-rank1`: at step 2 rank 1 alone runs one more forward and backward (an auxiliary objective's
    pass). Plain torchrun: exit 1 after 10 s; 12 steps run, then at the end rank 1 aborts in gloo ("Received data size
    doesn't match expected size. Is there a distributed collective mismatch") and rank 0 fails in `full_tensor()`.
    Before, the finding named step 7 (where rank 0 was when the check noticed) and advised evaluating on every
    rank."""
    run = check(["--nproc-per-node", "2", "--timeout", "40", SCRIPT, "--mistake", "aux-rank1"], tmp_path)
    assert run.rc == 1 and run.report is not None, run.output
    finding = run.finding("sharded-forward-some-ranks")
    assert finding["ranks"] == [0, 1] and finding["steps"] == [2], finding
    at = line_of("F.cross_entropy(model(torch.randn(8, 16, generator=g)), y).backward()")
    assert finding["sites"][0].endswith(at), finding
    assert "evaluate" not in finding["fix"] and "backward" in finding["fix"], finding


def test_a_collective_rank_0_calls_alone_is_named_where_the_job_hangs(tmp_path: Path) -> None:
    """log-rank0: the job hangs; once neither rank has moved for --hang-after's 10 s (the default --timeout of 600 s
    would outlast this test's own limit) the beacons name the all_reduce rank 0 called alone, and rank 1's next
    forward, whose all-gathers wait for it (before: two `rank-hung` findings, the cause unnamed)."""
    args = ["--hang-after", "10", "--nproc-per-node", "2", "--no-verify", SCRIPT, "--mistake", "log-rank0"]
    run = check(args, tmp_path, timeout=120)
    assert run.rc == 1 and {f["code"] for f in run.report["findings"]} == {"collective-mismatch"}, run.output
    mismatch = run.finding("collective-mismatch")
    called = line_of("dist.all_reduce(mean)")
    assert mismatch["sites"][0] == f"tests/scripts/{called}" and 3 in mismatch["steps"], mismatch
    assert (mismatch["labels"]["call"], mismatch["labels"]["ranks_skipped"]) == ("all_reduce(float32[])", "1"), mismatch
    assert mismatch["ranks"] == [0, 1] and "call it on every rank" in mismatch["fix"], mismatch
