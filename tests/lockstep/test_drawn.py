"""`uneven-inputs` from the batches each optimizer step drew from the training loader: ranks that draw a batch
without a step (a `continue` past a bad sample on some ranks only) take fewer steps per epoch than the others.

Ground truth under plain torchrun (2 ranks, 512 samples, `DistributedSampler`, batch 16: 16 batches per rank and
epoch; rank 1 `continue`s past its batch 3 in the first epoch, 2 epochs): rank 1 ended its first epoch after 15
optimizer steps and rank 0 after 16, so from then on each of DDP's all-reduces paired a step of one epoch on rank 0
with a step of the other on rank 1, silently; after the last epoch rank 1 left while rank 0 waited in its last
backward's all-reduce, which failed with "Connection closed by peer" (exit 1, 6 s; NCCL waits for the timeout).
Before, `check` said "No problems found": the loader's length, the inputs and the collectives all agree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkrun import SCRIPTS, check, line_of
from dist import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_doctor import observe
from ddp_doctor.observation import dataloaders

STEPS = 5
SKIPPED = 2
"""The batch the skipping ranks pass over: the step it falls in draws two batches there."""


def _train(rank: int, world: int, pattern: str) -> dict:
    dataloaders.install()  # as the launcher does before the script: loaders get their creation line
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))  # the training loader
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    skips = {"rank1": rank == 1, "odd_ranks": rank % 2 == 1, "every_rank": True}.get(pattern, False)
    accumulate = 2 if pattern == "accumulate" else 1
    with observe(ddp, optimizer=opt, steps=STEPS) as doctor:
        taken = 0
        for batch, (x, y) in enumerate(loader):
            if skips and batch == SKIPPED:
                continue
            last = (batch + 1) % accumulate == 0
            if last:
                F.cross_entropy(ddp(x), y).backward()
            else:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x), y).backward()
                continue
            opt.step()
            opt.zero_grad()
            taken += 1
            if taken == STEPS:
                break
    report = doctor.report()
    return {"findings": {f.code: f.to_dict() for f in report.findings}, "compared": report.compared}


def _measured(f: dict) -> dict[str, float]:
    return {m["name"]: m["value"] for m in f["measured"]}


def test_a_batch_skipped_on_rank_1_is_named_at_its_step(tmp_path) -> None:
    for out in run_ranks(_train, tmp_path, args=("rank1",)):
        found = out["findings"]
        assert set(found) == {"uneven-inputs"}, found
        f = found["uneven-inputs"]
        assert f["severity"] == "error" and f["ranks"] == [1] and f["steps"] == [SKIPPED], f
        assert _measured(f) == {"batches_drawn": 2, "batches_drawn_by_others": 1}, f
        assert f["sites"] == [f"tests/lockstep/test_drawn.py:{line_of(__file__, '# the training ' + 'loader')}"]


def test_batches_skipped_on_odd_ranks_are_named_at_four_ranks(tmp_path) -> None:
    for out in run_ranks(_train, tmp_path, world_size=4, args=("odd_ranks",)):
        f = out["findings"]["uneven-inputs"]
        assert f["ranks"] == [1, 3] and f["steps"] == [SKIPPED], f


@pytest.mark.parametrize("pattern", ["every_rank", "accumulate", "none"])
def test_steps_that_draw_alike_say_nothing_and_say_what_was_compared(tmp_path, pattern) -> None:
    """Every rank skipping the same batch, or accumulating two micro-batches per step, draws alike."""
    for out in run_ranks(_train, tmp_path, args=(pattern,)):
        assert out["findings"] == {}, out["findings"]
        assert out["compared"]["batches_drawn"] == STEPS, out["compared"]
        assert out["compared"]["samplers"] is True, out["compared"]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_check_names_the_skip_under_ddp_and_fsdp2_alike(tmp_path, wrap) -> None:
    """Through `ddp-doctor check`, a script whose rank 1 `continue`s past its batch 3 (FSDP2: the same rule, from
    its own exchange), and its clean neighbour that skips the batch on every rank."""
    script = SCRIPTS / "skip_batch.py"
    run = check(["--nproc-per-node", "2", str(script), "--wrap", wrap], tmp_path)
    f = run.finding("uneven-inputs")
    assert f["ranks"] == [1] and f["steps"] == [3], f
    assert {m["name"]: m["value"] for m in f["measured"]} == {"batches_drawn": 2, "batches_drawn_by_others": 1}, f
    assert f["sites"] == [f"tests/scripts/skip_batch.py:{line_of(script, 'sampler=sampler)')}"], f
    clean = check(["--nproc-per-node", "2", str(script), "--wrap", wrap, "--skip", "every-rank"], tmp_path / "clean")
    assert clean.codes == set(), clean.codes
