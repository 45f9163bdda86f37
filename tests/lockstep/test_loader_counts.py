"""Every loader's batches per pass are counted on every rank, with or without `len()`, and compared; the files the
script wrote under the check and what the check left unchecked are in the report. Real gloo runs of
`tests/scripts/uneven_stream.py`: an IterableDataset that shards its records by rank (no len(), no sampler).

Ground truth under plain torchrun (torch 2.13 CPU, gloo, 3 epochs, batch size 4):
- `--shards 20,16` (2 ranks): rank 0 runs 5 batches per epoch, rank 1 4. Each rank prints "epoch N: 5 steps" /
  "4 steps" (the epochs drift apart silently); rank 1 finishes its 12 steps and leaves, and rank 0 crashes in its
  13th step: "RuntimeError: ... Connection closed by peer" (exit 1, about 25 s).
- `--shards 12,12,8,12` (4 ranks): 3, 3, 2, 3 batches per epoch; rank 2 leaves after 6 steps, ranks 0, 1 and 3
  crash with "Connection closed by peer". (The test runs 10 epochs, so that rank 2 outlasts the 8 observed steps.)
- `--shards 16,16`: 4 batches each per epoch; runs to its end (exit 0).
- `--shards 16,16 --grow 4`: 4 batches each in epoch 0, then rank 1 gets 5 in epoch 1 (rank 0 4): rank 1 crashes
  with "Connection closed by peer" in epoch 2 (exit 1).
- `--shards 16,16 --snapshot S --log-file L` after a check of the same command: the check leaves S (epoch 1's
  snapshot) and L behind, and the next real run prints "resumed from S at epoch 2": it skips two epochs of training.
Before this, the check said "No problems found" and "Recommendation (verified)" for the first three.
"""

from __future__ import annotations

from pathlib import Path

from checkrun import SCRIPTS, Run, check

SCRIPT = str(SCRIPTS / "uneven_stream.py")


def line_of(text: str) -> str:
    [n] = [i for i, line in enumerate(Path(SCRIPT).read_text().splitlines(), 1) if text in line]
    return f"tests/scripts/uneven_stream.py:{n}"


LOADER = line_of("return DataLoader(data, batch_size=4)")
SAVE = line_of("torch.save(")
LOG = line_of("with open(args.log_file")


def run(tmp_path: Path, *script_args: str, ranks: int = 2, check_args: tuple[str, ...] = ()) -> Run:
    return check(["--nproc-per-node", str(ranks), *check_args, SCRIPT, *script_args], tmp_path)


TIMED = {"straggler-rank", "input-bound"}
"""Findings from measured step times: on a machine shared with other runs they come and go with the load."""


def warnings_or_errors(run: Run) -> set[str]:
    assert run.report is not None, run.output
    return {f["code"] for f in run.report["findings"] if f["severity"] in ("error", "warning")} - TIMED


def measured(finding: dict) -> dict[str, float]:
    return {m["name"]: m["value"] for m in finding["measured"]}


def loaders(run: Run) -> list[dict]:
    return [d for d in run.report["following"]["loaders"] if d["site"] == LOADER]


def test_an_iterable_dataset_sharded_unevenly_is_uneven_inputs_with_each_ranks_count(tmp_path: Path) -> None:
    result = run(tmp_path, "--shards", "20,16")
    assert result.rc == 1 and warnings_or_errors(result) == {"uneven-inputs"}, result.output
    uneven = result.finding("uneven-inputs")
    assert uneven["severity"] == "error" and uneven["ranks"] == [1], uneven
    assert any(site.endswith(LOADER) for site in uneven["sites"]), uneven
    counts = {"batches_most": 5, "batches_fewest": 4, "batches (rank 0)": 5, "batches (rank 1)": 4}
    assert counts.items() <= measured(uneven).items(), uneven
    assert "No problems found" not in result.output and "(rank 0: 5, rank 1: 4)" in result.output, result.output
    [training] = [d for d in loaders(result) if d["training"]]
    assert training["counted"]["by_rank"] == [5, 4] and training["counted"]["pass"] == 1, training
    assert training["no_len"], training  # an iterable dataset: no len() told the ranks apart before the epoch ended


def test_four_ranks_one_short_name_the_short_rank_and_every_count(tmp_path: Path) -> None:
    result = run(tmp_path, "--shards", "12,12,8,12", "--epochs", "10", ranks=4)
    uneven = result.finding("uneven-inputs")
    assert uneven["severity"] == "error" and uneven["ranks"] == [2], uneven
    by_rank = {f"batches (rank {r})": n for r, n in enumerate((3, 3, 2, 3))}
    assert {"batches_most": 3, "batches_fewest": 2, **by_rank}.items() <= measured(uneven).items(), uneven


def test_the_first_pass_counted_within_the_observed_steps_is_compared_with_following_off(tmp_path: Path) -> None:
    # --follow-epochs 0: the observed steps ran the first pass to its end on every rank; its counts still compare,
    # and the report says what the stop after the observed steps left unchecked.
    result = run(tmp_path, "--shards", "20,16", check_args=("--follow-epochs", "0"))
    uneven = result.finding("uneven-inputs")
    assert {"batches (rank 0)": 5, "batches (rank 1)": 4}.items() <= measured(uneven).items(), result.output
    assert "following" not in result.report, result.report.keys()
    [off] = [u for u in result.report["unchecked"] if u.startswith("--follow-epochs 0")]
    assert "epoch end" in off and "went unchecked" in off, off
    assert "Not checked: --follow-epochs 0" in result.output, result.output


def _clean_but_capped(result: Run) -> None:
    assert result.rc == 0 and warnings_or_errors(result) == set(), result.output
    [training] = [d for d in loaders(result) if d["training"]]
    assert training["counted"]["by_rank"] == [4, 4] and training["no_len"], training
    [hidden] = [u for u in result.report["unchecked"] if LOADER in u]
    assert "counted on every rank in its first pass (4 each)" in hidden, hidden
    assert "a later pass was capped by the check" in hidden and "would not show" in hidden, hidden
    assert "Not checked: The DataLoader built at" in result.output, result.output


def test_equal_shards_are_clean(tmp_path: Path) -> None:
    _clean_but_capped(run(tmp_path, "--shards", "16,16"))


def test_a_capped_later_pass_is_said_to_hide_a_difference(tmp_path: Path) -> None:
    # Epoch 1 gives rank 1 a fifth batch (the plain run crashes in epoch 2); the check ended that pass after the
    # observed steps, so it cannot know: it says so, and makes no claim either way.
    _clean_but_capped(run(tmp_path, "--shards", "16,16", "--grow", "4"))


def test_two_loaders_built_at_one_line_are_told_apart_by_creation_order(tmp_path: Path) -> None:
    result = run(tmp_path, "--shards", "16,16", "--eval")
    assert warnings_or_errors(result) == set(), result.output
    by_ordinal = {d["ordinal"]: d for d in loaders(result)}
    assert sorted(by_ordinal) == [1, 2], loaders(result)
    assert by_ordinal[1]["training"] and not by_ordinal[2]["training"], by_ordinal
    assert by_ordinal[2]["counted"]["by_rank"] == [2, 2], by_ordinal[2]
    assert f"loader #2 {LOADER} (evaluation or other" in result.output.replace("\n", " "), result.output


def test_an_uneven_evaluation_loader_is_a_warning_naming_it(tmp_path: Path) -> None:
    # The held-out shards are equal; an uneven training set makes the training loader #1 the error, and its
    # evaluation loader (#2, built at the same line) stays clean.
    result = run(tmp_path, "--shards", "20,16", "--eval")
    findings = [f for f in result.report["findings"] if f["code"] == "uneven-inputs"]
    assert len(findings) == 1 and f"built at {LOADER} (rank 0: 5" in findings[0]["title"], findings


def test_files_the_script_wrote_under_the_check_are_listed_with_the_next_run_warning(tmp_path: Path) -> None:
    snapshot, log = tmp_path / "snapshot.pt", tmp_path / "train.log"
    result = run(tmp_path, "--shards", "16,16", "--snapshot", str(snapshot), "--log-file", str(log))
    assert result.rc == 0 and snapshot.exists() and log.exists(), result.output
    written = {w["path"]: w for w in result.report["files_written"]}
    assert set(written) == {str(snapshot), str(log)}, written
    assert written[str(snapshot)]["how"] == "torch.save" and written[str(snapshot)]["site"] == SAVE, written
    assert written[str(log)]["how"] == "open()" and written[str(log)]["site"] == LOG, written
    assert all(w["ranks"] == [0] and not w["existed"] for w in written.values()), written
    text = " ".join(result.output.split())
    assert "The script wrote 2 file(s) while under the check" in text, result.output
    assert "the script will find them on its next run" in text, result.output
    # The terminal wraps a long path inside itself (pytest-xdist's temporary folders are long): compare unwrapped.
    assert str(snapshot) in "".join(result.output.split()), result.output
