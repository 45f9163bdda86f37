"""`check` follows scripts of the HF Trainer, Accelerate and Lightning through their epoch end, evaluation included
(`--follow-epochs`, on by default): real gloo runs on 2 ranks, CPU, tiny models built in the scripts. Each script
has 32 training and 16 evaluation batches a rank and 3 epochs; the run must cut the epoch short, evaluate on the
capped evaluation loader at the epoch end, and stop at the next epoch's first step. Each framework rebuilds or
drives the loaders its own way: Accelerate rebuilds both as DataLoaderShards (one batch read ahead) at one line of
its own, the HF Trainer builds and prepares them itself (a new evaluation loader at each evaluate()), Lightning
rebuilds them with a DistributedSampler and validates by counting batches. The wrong variant of each has rank 0
alone run the model over 400 batches at 0.1 s at the epoch end, under a 20 s process-group timeout (the plain run
dies there): `timeout-risk`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from checkrun import SCRIPTS, Run, check
from frameworkrun import OFFLINE

pytestmark = pytest.mark.timeout(240)

OBSERVED = 8
"""`check`'s default --steps: the training pass is ended after them."""


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)


def follow(tmp_path: Path, script: str, *script_args: str) -> Run:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / script), *script_args], tmp_path)
    assert run.report is not None, run.output
    return run


def warnings_or_errors(run: Run) -> set[str]:
    return {f["code"] for f in run.report["findings"] if f["severity"] in ("error", "warning")}


def followed(run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
    """The report's following section after one epoch end: its training loader and its evaluation loader."""
    following = run.report["following"]
    assert following["epoch_ends"] == 1, following
    assert "the next epoch's first step" in following["ended_by"], following
    assert "followed 1 epoch end(s)" in run.output, run.output
    [training] = [d for d in following["loaders"] if d["training"]]
    # Cut short: the observed pass ended after the observed steps (one batch more where the framework reads one
    # ahead), and the next epoch's pass was left at its first step.
    assert training["batches"]["by_rank"] == [32, 32] and training["passes"] == 2, training
    assert OBSERVED <= training["most"] <= OBSERVED + 1 and training["capped"] == 1, training
    [evaluation] = [d for d in following["loaders"] if not d["training"] and d["batches"]["max"] == 16]
    assert evaluation["batches"]["by_rank"] == [16, 16], evaluation
    assert evaluation["most"] == following["limit_batches"] == 2 and evaluation["capped"] == 1, evaluation
    return training, evaluation


def alone_too_long(run: Run, site: str, raise_timeout: str) -> None:
    """Rank 0's lone work at the epoch end (2 of 400 batches at 0.1 s, projected to 40 s) reaches the 20 s timeout;
    the fix raises the timeout in the framework's words (`raise_timeout`)."""
    assert warnings_or_errors(run) == {"timeout-risk"}, run.output
    risk = run.finding("timeout-risk")
    assert risk["severity"] == "error" and risk["ranks"] == [0], risk
    measured = {m["name"]: m["value"] for m in risk["measured"]}
    assert measured["group_timeout"] == 20 and measured["alone_projected"] >= 20, risk
    assert any(s.endswith(site) for s in risk["sites"]) and f"{site}: 2 of 400 batches" in risk["detail"], risk
    assert raise_timeout in risk["fix"], risk
    assert run.report["following"]["epoch_ends"] == 1, run.report["following"]
    assert run.seconds < 60, run.seconds


def test_accelerate_loop_is_followed_through_its_epoch_end_and_evaluation(tmp_path: Path) -> None:
    run = follow(tmp_path, "accelerate_epochs.py")
    assert run.rc == 0 and warnings_or_errors(run) == set(), run.output
    assert run.seconds < 60, run.seconds
    training, evaluation = followed(run)
    # prepare() rebuilt both at one line of Accelerate's; each is named by the user's loader it came from, with the
    # sampler that orders it (inside Accelerate's BatchSamplerShard).
    assert (training["site"], training["sampler"]) == ("tests/scripts/accelerate_epochs.py:39", "RandomSampler")
    assert (evaluation["site"], evaluation["sampler"]) == ("tests/scripts/accelerate_epochs.py:40", "SequentialSampler")
    assert training["most"] == OBSERVED + 1, training  # DataLoaderShard reads one batch ahead
    # Every rank evaluated its capped shard and gathered it: 2 batches of 4 on each of 2 ranks.
    assert "epoch 0: accuracy" in run.output and "on 16 samples" in run.output, run.output
    assert "epoch 1: accuracy" not in run.output, run.output


@pytest.mark.serial
def test_accelerate_rank_0_evaluating_alone_past_the_timeout_is_timeout_risk(tmp_path: Path) -> None:
    run = follow(tmp_path, "accelerate_epochs.py", "--eval-rank0", "0.1")
    alone_too_long(run, "tests/scripts/accelerate_epochs.py:42", "InitProcessGroupKwargs(timeout=")


def test_hf_trainer_is_followed_through_its_epoch_end_and_evaluation(tmp_path: Path) -> None:
    run = follow(tmp_path, "hf_epochs.py", str(tmp_path / "out"))
    assert run.rc == 0 and warnings_or_errors(run) == set(), run.output
    assert run.seconds < 60, run.seconds
    training, evaluation = followed(run)
    # The Trainer builds both loaders at one line of its own and prepares them through Accelerate.
    assert "transformers/trainer.py:" in training["site"] and training["site"] == evaluation["site"], training
    assert training["sampler"].endswith("RandomSampler") and evaluation["sampler"] == "SequentialSampler"
    assert training["most"] == OBSERVED + 1, training  # Accelerate's DataLoaderShard reads one batch ahead
    # eval_strategy="epoch" ran at the capped epoch end, compute_metrics included, once.
    assert run.output.count("'eval_accuracy'") == 1, run.output


@pytest.mark.serial
def test_hf_trainer_callback_working_alone_on_the_main_process_is_timeout_risk(tmp_path: Path) -> None:
    run = follow(tmp_path, "hf_epochs.py", str(tmp_path / "out"), "--rank0-samples", "0.1")
    alone_too_long(run, "tests/scripts/hf_epochs.py:56", "ddp_timeout=")


def test_lightning_fit_is_followed_through_its_epoch_end_and_validation(tmp_path: Path) -> None:
    run = follow(tmp_path, "lightning_epochs.py", str(tmp_path / "root"))
    assert run.rc == 0 and warnings_or_errors(run) == set(), run.output
    assert run.seconds < 60, run.seconds
    training, evaluation = followed(run)
    # Lightning rebuilt both with a DistributedSampler; each is named by the user's loader it came from.
    assert (training["site"], evaluation["site"]) == (
        "tests/scripts/lightning_epochs.py:57",
        "tests/scripts/lightning_epochs.py:60",
    )
    assert training["sampler"] == evaluation["sampler"] == "DistributedSampler"
    assert training["most"] == OBSERVED, training  # a sized loader: Lightning reads no batch ahead
    # Two validation passes: the sanity check before training (2 batches, Lightning's own limit), and the one at
    # the capped epoch end, which Lightning schedules by counting batches against len().
    assert evaluation["passes"] == 2, evaluation
    assert "epoch 0: val_acc" in run.output and "epoch 1: val_acc" not in run.output, run.output


@pytest.mark.serial
def test_lightning_rank_0_working_alone_after_validation_is_timeout_risk(tmp_path: Path) -> None:
    run = follow(tmp_path, "lightning_epochs.py", str(tmp_path / "root"), "--rank0-export", "0.1")
    alone_too_long(run, "tests/scripts/lightning_epochs.py:52", "DDPStrategy(timeout=")
