"""`check` follows an FSDP2 job through its epoch end, as it does a DDP job (`--follow-epochs`, on by default):
tests/scripts/fsdp2_epochs.py, a `fully_shard` loop over a DataLoader that evaluates on every rank and saves with
torch.distributed.checkpoint at each epoch end, in its variants.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 3 epochs of 16 batches:
- clean: exit code 0, a validation loss per rank and epoch.
- --eval-rank0 (rank 0 alone evaluates): its first evaluation forward all-gathers on rank 0 alone; gloo aborts
  rank 1 (*Received data size doesn't match expected size*, 260 vs 4 bytes) at the first epoch end, rank 0 then
  fails with *Connection reset by peer*. No evaluation loss is printed.
- --gather-rank0 (a full state dict gathered on rank 0 alone): gloo aborts rank 0 (1088 vs 1024 bytes) after the
  first epoch's evaluation.
- --uneven (no DistributedSampler; rank 0 reads 20 batches per epoch, rank 1 12): gloo aborts rank 1 (4160 vs 1088
  bytes) when it reaches its evaluation while rank 0 still trains.
- --save-rank0 (rank 0 alone: `torch.save(model.state_dict(), path)`, after every rank's evaluation): gloo aborts
  rank 0 at the next epoch's first forward (1088 vs 260 bytes). Not the save: `model.state_dict()` alone on rank 0
  does the same, and every rank calling it (rank 0 saving) ends with exit code 0. The evaluation's forward, with no
  backward after it, left the root unsharded; `state_dict()` reshards it on rank 0 only, so rank 0's next forward
  all-gathers the root's parameters while rank 1 all-gathers the first block's. And the file holds rank 0's shards.
- --save-rank0 --no-eval: exit code 0; each file holds rank 0's shards (0.weight: a DTensor of local shape 32x16,
  64x16 in full), which load into nothing but the same sharding.
- --no-set-epoch: exit code 0, silently; every epoch visits the samples in the same order.
Before the check followed FSDP2 jobs, it stopped each after its 8 observed steps: none of these was seen, and the
report said so ("a save after those steps, forwards and full-state-dict gathers on some ranks only").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, Run, check

SCRIPT = str(SCRIPTS / "fsdp2_epochs.py")


def line_of(text: str) -> str:
    """`fsdp2_epochs.py:N` of the one line of the script holding `text`."""
    [n] = [i for i, line in enumerate(Path(SCRIPT).read_text().splitlines(), 1) if text in line]
    return f"fsdp2_epochs.py:{n}"


def _check(tmp_path: Path, *mistake: str) -> Run:
    args = ["--nproc-per-node", "2", "--no-verify", SCRIPT, "--out", str(tmp_path), *mistake]
    return check(args, tmp_path, timeout=180)


def _serious(run: Run) -> set[str]:
    assert run.report is not None, run.output
    return {f["code"] for f in run.report["findings"] if f["severity"] in ("error", "warning")}


def test_a_clean_fsdp2_job_is_followed_through_its_epoch_end_and_stays_clean(tmp_path: Path) -> None:
    run = _check(tmp_path)
    assert run.rc == 0 and _serious(run) == set(), run.output
    assert run.report["parallelism"] == "fsdp2" and run.report["steps_observed"] == 8, run.report
    following = run.report["following"]
    assert following["epoch_ends"] == 1 and "next epoch's first step" in following["ended_by"], following
    train = next(d for d in following["loaders"] if d["training"])
    assert train["batches"]["by_rank"] == [16, 16] and train["site"].endswith(line_of("train = DataLoader(data")), train
    assert "followed 1 epoch end(s)" in run.output, run.output


def test_a_loop_that_calls_next_itself_is_reported_where_following_ended_its_pass(tmp_path: Path) -> None:
    """`it = iter(loader)` and `next(it)` for len(loader) steps (in a generator expression): following caps the
    pass, so the loop's next() raises StopIteration that plain torchrun never raises (3 epochs, exit code 0 there). The report is the observed
    steps' with following's end. Before, the path without DDP wrote a report with no model, and the check printed
    nothing and exited 2 (found on a GPU, tests/scripts/gpu_input.py)."""
    run = _check(tmp_path, "--next-loop")
    assert run.rc == 0 and _serious(run) == set(), run.output
    assert run.report["parallelism"] == "fsdp2", run.report
    assert "called next() on a DataLoader iterator" in run.report["following"]["ended_by"], run.report["following"]


@pytest.mark.serial  # the verdict rests on the wall-clock time of rank 0's work
def test_rank_0_working_alone_past_the_groups_timeout_at_the_epoch_end_is_timeout_risk(tmp_path: Path) -> None:
    """Rank 0 alone writes samples at the epoch end (400 batches of a loader, 0.1 s each, no sharded model in it)
    while the others go on to the DCP save's collectives; the group's timeout is 20 s. Ground truth, plain
    torchrun, torch 2.13.0, CPU, gloo, 2 ranks: exit code 1 after 39 s, rank 1 "Timed out waiting 20000ms for send
    operation to complete" in dcp.save. The check follows the epoch end with the loaders capped at 2 batches (0.2 s
    of work) and projects about 40 s at their real lengths."""
    run = _check(tmp_path, "--samples-rank0", "0.1", "--pg-timeout", "20")
    assert _serious(run) == {"timeout-risk"}, run.output
    risk = run.finding("timeout-risk")
    assert risk["severity"] == "error" and risk["ranks"] == [0], risk
    # 400 sleeps of 0.1 s projected from 2 of them: each overshoots its 0.1 s by a few ms (41 s seen here, alone).
    measured = {m["name"]: m["value"] for m in risk["measured"]}
    assert 39 <= measured["alone_projected"] < 45 and measured["group_timeout"] == 20, risk
    assert any(site.endswith(line_of("dcp.save(")) for site in risk["sites"]), risk  # where the others waited
    assert "2 of 400 batches" in risk["detail"], risk
    assert run.report["parallelism"] == "fsdp2" and run.report["following"]["epoch_ends"] == 1, run.report
    assert run.seconds < 60, run.seconds


def test_an_evaluation_on_rank_0_alone_at_the_epoch_end_is_named_with_the_steps_diagnosis(tmp_path: Path) -> None:
    run = _check(tmp_path, "--eval-rank0")
    assert run.rc == 1 and run.report["findings"][0]["code"] == "sharded-forward-some-ranks", run.output
    found = run.report["findings"][0]
    assert found["sites"] == [f"tests/scripts/{line_of('total += float(F.cross_entropy(model(x.to(device))')}"]
    assert found["labels"] == {"kind": "forward", "ranks_alone": "0"}, found
    assert _serious(run) <= {"sharded-forward-some-ranks", "rank-crashed"}, run.output
    assert "failed while check followed it" in run.output and run.report["steps_observed"] == 8, run.output


def test_a_full_state_dict_gathered_on_rank_0_alone_at_the_epoch_end_is_named(tmp_path: Path) -> None:
    run = _check(tmp_path, "--gather-rank0")
    assert run.rc == 1 and run.report["findings"][0]["code"] == "state-gather-some-ranks", run.output
    found = run.report["findings"][0]
    assert found["sites"] == [f"tests/scripts/{line_of('full = get_model_state_dict(')}"], found
    assert (found["labels"]["call"], found["labels"]["ranks_alone"]) == ("get_model_state_dict", "0"), found
    assert _serious(run) <= {"state-gather-some-ranks", "rank-crashed"}, run.output


def test_a_state_dict_on_rank_0_alone_after_an_evaluation_is_named_as_the_failure_it_caused(tmp_path: Path) -> None:
    run = _check(tmp_path, "--save-rank0")
    assert run.rc == 1 and run.report["findings"][0]["code"] == "sharded-checkpoint-incomplete", run.output
    found = run.report["findings"][0]
    assert found["sites"] == [f"tests/scripts/{line_of('torch.save(model.state_dict(), os.path')}"], found
    assert found["labels"] == {"kind": "state-dict-some-ranks", "ranks_alone": "0"}, found
    assert "torch.distributed.checkpoint.save" in found["fix"] and "accelerator.save_state" in found["fix"], found
    assert _serious(run) <= {"sharded-checkpoint-incomplete", "rank-crashed"}, run.output
    crashed = [f for f in run.report["findings"] if f["code"] == "rank-crashed"]
    # Where rank 0 died, from its fault dump (every thread's: gloo aborts from a thread of its own).
    backward = f"tests/scripts/{line_of('F.cross_entropy(model(x.to(device)), y.to(device)).backward()')}"
    assert all(f["sites"] == [backward] for f in crashed), crashed
    assert all(f["caused_by"] == ["sharded-checkpoint-incomplete"] for f in crashed), crashed


def test_a_save_of_rank_0s_shards_at_the_epoch_end_is_named_in_the_report_after_following(tmp_path: Path) -> None:
    run = _check(tmp_path, "--save-rank0", "--no-eval")
    assert run.rc == 1 and _serious(run) == {"sharded-checkpoint-incomplete"}, run.output
    found = run.finding("sharded-checkpoint-incomplete")
    assert found["ranks"] == [0] and {m["name"]: m["value"] for m in found["measured"]}["saving_ranks"] == 1
    assert found["labels"]["kind"] == "some-ranks" and found["labels"]["file"] == str(tmp_path / "model-0.pt")
    assert found["labels"]["saves_checked"] == "observed-steps-and-epoch-end", found
    assert run.report["following"]["epoch_ends"] == 1, run.report["following"]


def test_ranks_with_different_numbers_of_batches_are_uneven_inputs_in_fsdp2_words(tmp_path: Path) -> None:
    """Also when the observed steps outlast the shorter rank's loader (`--steps 14`; rank 1 has 12 batches): rank 1
    evaluates while rank 0 trains, and gloo aborts it, as under plain torchrun. The cause named is the loaders'
    lengths, not "rank 1 ran a forward that rank 0 did not" (its evaluation runs on every rank, at different
    times), which the first version said."""
    longer = tmp_path / "steps14"
    longer.mkdir()
    args = ["--nproc-per-node", "2", "--no-verify", "--steps", "14", SCRIPT, "--out", str(longer), "--uneven"]
    failed = check(args, longer, timeout=180)
    assert failed.rc == 1 and failed.report["findings"][0]["code"] == "uneven-inputs", failed.output
    per_rank = {"batches (rank 0)": 20, "batches (rank 1)": 12}
    measured = {m["name"]: m["value"] for m in failed.report["findings"][0]["measured"]}
    assert per_rank.items() <= measured.items() and measured["batches_fewest"] == 12, failed.report["findings"][0]
    assert "sharded-forward-some-ranks" not in failed.codes, failed.output
    run = _check(tmp_path, "--uneven")
    assert _serious(run) == {"uneven-inputs"}, run.output
    found = run.finding("uneven-inputs")
    assert found["severity"] == "error", found
    assert per_rank.items() <= {m["name"]: m["value"] for m in found["measured"]}.items(), found
    assert "the sharded model's all-gathers and gradient reduce-scatters" in found["detail"], found
    assert "Join does not cover a sharded model" in found["fix"] and "Join([model])" not in found["fix"], found


def test_a_sampler_without_set_epoch_is_named_at_the_followed_epoch(tmp_path: Path) -> None:
    run = _check(tmp_path, "--no-set-epoch")
    assert run.rc == 0 and _serious(run) == {"sampler-epoch-not-set"}, run.output
    found = run.finding("sampler-epoch-not-set")
    assert found["sites"] == [f"tests/scripts/{line_of('train = DataLoader(data')}"], found
    assert {m["name"]: m["value"] for m in found["measured"]} == {"passes": 2, "epoch": 0}, found
