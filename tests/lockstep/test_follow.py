"""`check` follows the script through its epoch ends (`--follow-epochs`, on by default): the training pass ends after
the observed steps, every later DataLoader pass is capped, and what happens at the epoch end is diagnosed. Real
gloo runs of `tests/scripts/epoch_end.py` (a plain loop over a DataLoader) in its variants."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, Run, check

SCRIPT = str(SCRIPTS / "epoch_end.py")


def line_of(text: str) -> str:
    """`tests/scripts/epoch_end.py:N` of the one line of the script holding `text`."""
    [n] = [i for i, line in enumerate(Path(SCRIPT).read_text().splitlines(), 1) if text in line]
    return f"tests/scripts/epoch_end.py:{n}"


TRAIN_LOADER = line_of("sampler=DistributedSampler(data, shuffle=True)")
EVAL_LOADER = line_of("eval_loader = DataLoader(")


def follow(tmp_path: Path, *script_args: str, check_args: tuple[str, ...] = (), ranks: int = 2) -> Run:
    return check(["--nproc-per-node", str(ranks), *check_args, SCRIPT, *script_args], tmp_path)


def warnings_or_errors(run: Run) -> set[str]:
    assert run.report is not None, run.output
    return {f["code"] for f in run.report["findings"] if f["severity"] in ("error", "warning")}


def loader(run: Run, site: str) -> dict:
    found = [d for d in run.report["following"]["loaders"] if d["site"] == site]
    assert found, run.report["following"]
    return found[0]


@pytest.mark.serial
def test_rank_0_evaluating_alone_past_the_groups_timeout_is_timeout_risk_in_seconds(tmp_path: Path) -> None:
    # 400 evaluation batches at 0.1 s on rank 0 alone; the group's timeout is 20 s (the plain run dies there).
    run = follow(tmp_path, "--eval-rank0", "0.1", ranks=4)
    assert warnings_or_errors(run) == {"timeout-risk"}, run.output
    risk = run.finding("timeout-risk")
    assert risk["severity"] == "error" and risk["ranks"] == [0], risk
    measured = {m["name"]: m["value"] for m in risk["measured"]}
    assert measured["group_timeout"] == 20 and measured["alone_projected"] >= 20, risk  # 400 batches of 0.1 s
    assert any(site.endswith(EVAL_LOADER) for site in risk["sites"]), risk
    assert run.seconds < 60, run.seconds
    following = run.report["following"]
    assert following["epoch_ends"] == 1 and following["limit_batches"] == 2, following
    assert "next epoch's first step" in following["ended_by"], following
    evaluation = loader(run, EVAL_LOADER)
    assert evaluation["batches"]["by_rank"] == [400, None, None, None] and evaluation["most"] == 2, evaluation
    assert not evaluation["training"] and evaluation["capped"] == 1, evaluation
    training = loader(run, TRAIN_LOADER)
    assert training["batches"]["by_rank"] == [16] * 4 and training["training"], training
    assert "followed 1 epoch end(s)" in run.output, run.output


def test_a_capped_evaluation_that_still_outlasts_the_timeout_is_named_with_the_steps_diagnosis(tmp_path: Path) -> None:
    # Two capped batches of 3 s on rank 0 alone against a 4 s timeout: the real timeout fires while following.
    run = follow(tmp_path, "--eval-rank0", "3", "--pg-timeout", "4")
    assert run.rc == 1 and run.report["findings"][0]["code"] == "timeout-risk", run.output
    risk = run.report["findings"][0]
    assert risk["ranks"] == [0] and risk["labels"]["waited"] == "1", risk
    assert risk["labels"]["exception"] == "RuntimeError" and "Timed out" in risk["labels"]["message"], risk
    assert [(m["name"], m["value"]) for m in risk["measured"]] == [("group_timeout", 4)], risk
    assert "time.sleep(args.eval_rank0)" in risk["detail"], risk  # where rank 0 was: its innermost line
    # The observed steps' diagnosis survives the failure: their verified recommendation is still there.
    assert run.report["recommendation"]["verified"] and run.report["steps_observed"] == 8, run.report
    assert "rank-crashed" not in run.codes and "failed while check followed it" in run.output, run.output


def test_every_rank_saving_one_file_at_the_epoch_end_is_checkpoint_same_path(tmp_path: Path) -> None:
    # Rank 0 also evaluates alone, briefly (400 batches of 1 ms, 0.4 s projected): no timeout-risk for that.
    run = follow(tmp_path, "--save-every-rank", "--out", str(tmp_path / "last.pt"), "--eval-rank0", "0.001")
    assert warnings_or_errors(run) == {"checkpoint-same-path"}, run.output
    same = run.finding("checkpoint-same-path")
    assert same["ranks"] == [0, 1] and line_of("torch.save(") in same["detail"], same
    assert "at an epoch end the check followed" in same["detail"], same
    assert "checkpoint-module-prefix" in run.codes, run.output


def test_rank_0_evaluating_through_the_wrapper_with_batchnorm_is_collective_mismatch(tmp_path: Path) -> None:
    run = follow(tmp_path, "--eval-ddp", "--bn")
    assert warnings_or_errors(run) == {"collective-mismatch"}, run.output
    mismatch = run.finding("collective-mismatch")
    assert mismatch["ranks"] == [0] and line_of("total += float(model(x)") in mismatch["title"], mismatch
    assert "ddp_model.module" in mismatch["fix"], mismatch
    # Without buffers the same forward broadcasts nothing: no collective, nothing to pair wrongly.
    plain = follow(tmp_path / "no_bn", "--eval-ddp")
    assert warnings_or_errors(plain) == set(), plain.output


def test_a_sampler_without_set_epoch_is_named_at_the_followed_epoch(tmp_path: Path) -> None:
    run = follow(tmp_path, "--no-set-epoch")
    assert warnings_or_errors(run) == {"sampler-epoch-not-set"}, run.output
    assert TRAIN_LOADER in run.finding("sampler-epoch-not-set")["title"], run.finding("sampler-epoch-not-set")
    # PyTorch's DDP tutorial peeks at one batch before set_epoch every epoch: the peek at the followed epoch,
    # capped or not, is no epoch of its own.
    peek = follow(tmp_path / "peek", "--peek")
    assert warnings_or_errors(peek) == set(), peek.output


@pytest.mark.parametrize(
    ("variant", "length"),
    [
        (("--workers", "2"), 32),  # map-style, worker processes
        (("--workers", "2", "--persistent"), 32),  # the same workers kept between epochs
        (("--iterable",), 32),  # an iterable dataset with a length
        (("--no-len",), None),  # an iterable dataset without one
        (("--recreate",), 32),  # a new loader (and sampler) each epoch, at one line
    ],
    ids=["workers", "persistent", "iterable", "no-len", "recreate"],
)
def test_capped_loaders_of_every_kind_end_the_epoch_and_are_listed(
    tmp_path: Path, variant: tuple[str, ...], length: int | None
) -> None:
    run = follow(tmp_path, *variant)
    assert warnings_or_errors(run) == set(), run.output
    following = run.report["following"]
    assert following["epoch_ends"] == 1 and "next epoch's first step" in following["ended_by"], following
    [training] = [d for d in following["loaders"] if d["training"]]
    assert training["batches"]["max"] == length and training["passes"] == 2, training
    assert training["capped"] >= 1 and training["most"] == 8, training


def test_two_epoch_ends_are_followed_and_zero_turns_following_off(tmp_path: Path) -> None:
    two = follow(tmp_path / "two", "--recreate", check_args=("--follow-epochs", "2"))
    following = two.report["following"]
    assert following["epoch_ends"] == 2 and following["epochs"] == 2, following
    [training] = [d for d in following["loaders"] if d["training"]]
    assert training["passes"] == 3, training  # 8 observed steps, a capped epoch of 2, the third epoch's start
    off = follow(tmp_path / "off", "--eval-rank0", "0.1", check_args=("--follow-epochs", "0"))
    assert "following" not in off.report and off.codes == set(), off.output


def test_a_loop_that_calls_next_itself_ends_following_where_its_pass_was_ended(tmp_path: Path) -> None:
    run = follow(tmp_path, "--next-loop")
    assert run.rc == 0 and warnings_or_errors(run) == set(), run.output
    assert "called next() on a DataLoader iterator" in run.report["following"]["ended_by"], run.report["following"]
    assert "rank-crashed" not in run.codes and "StopIteration" not in run.output, run.output


def test_a_step_based_script_says_no_epoch_end_was_reached(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "eval_rank0.py")], tmp_path)
    following = run.report["following"]
    assert following["epoch_ends"] == 0 and "No epoch end was reached" in following["note"], following
    assert "No epoch end was reached" in run.output, run.output


def test_follow_options_are_checked(tmp_path: Path) -> None:
    for args, message in (
        (["--limit-batches", "0"], "--limit-batches must be at least 1, got 0"),
        (["--follow-epochs", "-1"], "--follow-epochs must be 0 (off) or more, got -1"),
    ):
        run = check([*args, "--nproc-per-node", "2", SCRIPT], tmp_path)
        assert run.rc == 2 and message in run.output, run.output
