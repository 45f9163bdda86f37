"""Lightning jobs sharded with FSDP2: `ModelParallelStrategy` on CPU and gloo, `fully_shard` in `configure_model`
(tests/scripts/lightning_fsdp2.py, 2 ranks, 8 steps), followed by DoctorCallback and by `ddp-doctor check`.

Ground truth, plain torchrun, torch 2.13.0, lightning 2.6.6, CPU, gloo, 2 ranks, every run without the doctor:
- none: exit code 0; the head is a DTensor, its full weight sums 0.2781 on both ranks.
- root-unsharded (the LightningModule itself not sharded): exit code 0, nothing printed; the head stays a plain
  tensor on each rank and trains apart: its weight sums end at 1.1718 on rank 0 and -0.0002 on rank 1.
- --save rank0 (`torch.save(pl_module.state_dict())` under `if trainer.is_global_zero:`): exit code 0; the file
  holds DTensors of rank 0's shards: blocks.0.weight is [16, 8] of [32, 8].
- --save every (`trainer.save_checkpoint` on every rank): a folder of both ranks' shards (`__0_0.distcp`,
  `__1_0.distcp`, `meta.pt`); with `save_distributed_checkpoint=False`, one file of [32, 8] plain tensors.
- --save rank0-checkpoint (`trainer.save_checkpoint` under `if trainer.is_global_zero:`): the job hangs (killed
  after 100 s, exit code 124), with a distributed checkpoint and with one file (`--full-checkpoint`) alike.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from checkrun import SCRIPTS, check
from frameworkrun import codes, finding, load, params, same_findings, torchrun

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(300)

SCRIPT = str(SCRIPTS / "lightning_fsdp2.py")
HEAD = {"head.weight", "head.bias"}


def _line_of(text: str) -> str:
    """`lightning_fsdp2.py:N` of the script's line holding `text`."""
    return f"lightning_fsdp2.py:{next(i for i, line in enumerate(Path(SCRIPT).read_text().splitlines(), 1) if text in line)}"


def _measured(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_clean_sharded_lightning_job_is_clean_and_named_fsdp2(tmp_path: Path) -> None:
    run = torchrun("lightning_fsdp2.py", [str(tmp_path), "--callback", "--out", str(tmp_path)], tmp_path)
    assert run.finished, run.output[-6000:]
    report = load(tmp_path / "ddp_doctor.json", run)
    assert report["parallelism"] == "fsdp2" and report["framework"] == "lightning", report
    assert report["steps_observed"] == 6 and report["findings"] == [], report["findings"]
    assert report["sharding"]["root_sharded"] is True
    assert {m["sharded_head"] for m in _measured(tmp_path)} == {True}


def test_the_lightning_module_left_unsharded_is_named_in_lightnings_words(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    args = [str(root), "--mistake", "root-unsharded", "--callback", "--out", str(root)]
    run = torchrun("lightning_fsdp2.py", args, tmp_path)
    assert run.finished, run.output[-6000:]  # fail_on="never"
    report = load(root / "ddp_doctor.json", run)
    assert report["parallelism"] == "fsdp2" and report["framework"] == "lightning"
    assert codes(report) == {"unsharded-params-not-synced"}, report["findings"]
    found = finding(report, "unsharded-params-not-synced")
    assert found["severity"] == "error" and params(report, "unsharded-params-not-synced") == HEAD
    assert 'end `configure_model` with `fully_shard(self, mesh=self.device_mesh["data_parallel"])`' in found["fix"]
    sums = [m["head_sum"] for m in _measured(root)]
    assert abs(sums[0] - sums[1]) > 1e-3, sums  # measured in the same run: the heads did train apart

    checked = check(
        [
            "--nproc-per-node",
            "2",
            "--steps",
            "6",
            SCRIPT,
            str(tmp_path / "c"),
            "--mistake",
            "root-unsharded",
            "--callback",
        ],
        tmp_path / "check",
        timeout=180,
    )
    assert checked.rc == 1 and checked.report is not None, checked.output[-6000:]
    same_findings(report, checked.report)
    assert "ddp-doctor report after" not in checked.output  # the callback stood by under the check


def test_rank_0_saving_its_shards_alone_is_named_with_lightnings_fix(tmp_path: Path) -> None:
    run = check(
        ["--nproc-per-node", "2", "--no-verify", SCRIPT, str(tmp_path), "--save", "rank0", "--out", str(tmp_path)],
        tmp_path,
        timeout=180,
    )
    assert run.rc == 1 and run.report is not None, run.output[-6000:]
    assert run.report["framework"] == "lightning" and run.codes == {"sharded-checkpoint-incomplete"}, run.codes
    found = run.finding("sharded-checkpoint-incomplete")
    assert re.search(rf"{_line_of('torch.save(pl_module.state_dict(), os.path')}\b", found["detail"])
    assert found["ranks"] == [0]
    assert "16x8 of 32x8" in found["detail"]
    assert "`trainer.save_checkpoint(path)` on every rank" in found["fix"]
    measured = _measured(tmp_path)[0]
    assert (measured["saved_local"], measured["saved_global"]) == ([16, 8], [32, 8])  # what the file holds


@pytest.mark.parametrize(
    ("full", "code"),
    [(False, "sharded-checkpoint-incomplete"), (True, "state-gather-some-ranks")],
    ids=["distributed", "full-state-dict"],
)
def test_rank_0_calling_save_checkpoint_alone_is_named_at_the_scripts_line(tmp_path: Path, full, code) -> None:
    """The job hangs either way: rank 0 takes the state dict inside Lightning's save_checkpoint (and, saving one
    file, gathers it in full), while rank 1 goes on to its next forward. `--hang-after` ends the check once neither
    rank has moved for 10 s (the default --timeout of 600 s would outlast this test's own limit), and the report names
    the script's own line, not Lightning's."""
    args = [SCRIPT, str(tmp_path), "--save", "rank0-checkpoint", *(["--full-checkpoint"] if full else [])]
    run = check(["--nproc-per-node", "2", "--hang-after", "10", *args], tmp_path, timeout=150)
    assert run.report is not None, run.output[-6000:]
    assert run.report["framework"] == "lightning", run.report["framework"]
    found = run.finding(code)
    assert re.search(rf"{_line_of('trainer.save_checkpoint(os.path')}\b", found["title"]), found["title"]
    assert found["ranks"] == [0, 1]
    assert "not under `if trainer.is_global_zero:`" in found["fix"]
