"""`shards-overlap` on real gloo ranks: the training loader's DistributedSampler must hold the same settings on every
rank but its rank, and be its own rank's. Ground truth under plain torchrun (2 ranks, 512 samples, batch 16,
`DistributedSampler(ds, shuffle=True, seed=rank)`): exit 0, nothing printed, loss falling; each rank reads 256
indices per epoch, 125 of them the other rank's too, and 125 indices are read by neither rank. Before, `check`
said "No problems found"."""

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

STEPS = 4


def _train(rank: int, world: int, pattern: str) -> dict:
    dataloaders.install()  # as the launcher does before the script: loaders get their creation line
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    if pattern in ("whole_random", "whole_sequential", "own_data"):
        # No DistributedSampler: every rank orders its whole dataset (the same one, or with `own_data` its own).
        if pattern == "own_data":
            data = TensorDataset(torch.randn(512, 8, generator=torch.Generator().manual_seed(rank)), data.tensors[1])
        torch.manual_seed(100 + rank)  # a per-rank seed: the random orders, and the batches, differ
        loader = DataLoader(data, batch_size=16, shuffle=pattern != "whole_sequential")
    else:
        kwargs = {
            "seed_per_rank": {"seed": rank},
            "one_replica": {"num_replicas": 1, "rank": 0},
            "same_seed": {"seed": 1234},
            "default": {},
        }[pattern]
        sampler = DistributedSampler(data, shuffle=True, **kwargs)
        sampler.set_epoch(0)
        loader = DataLoader(data, batch_size=16, sampler=sampler)  # named in the finding
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with observe(ddp, optimizer=opt, steps=STEPS) as doctor:
        for step, (x, y) in enumerate(loader):
            if step == STEPS:
                break
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    report = doctor.report()
    return {f.code: f.to_dict() for f in report.findings}


def _measured(f: dict) -> dict[str, float]:
    return {m["name"]: m["value"] for m in f["measured"]}


def test_a_seed_per_rank_in_the_sampler_is_named_with_the_overlap_at_four_ranks(tmp_path) -> None:
    for found in run_ranks(_train, tmp_path, world_size=4, args=("seed_per_rank",)):
        assert set(found) == {"shards-overlap"}, found
        f = found["shards-overlap"]
        assert f["severity"] == "warning" and f["ranks"] == [0, 1, 2, 3], f
        assert f["sites"] == [f"tests/lockstep/test_shards.py:{line_of(__file__, '# named in ' + 'the finding')}"], f
        # Rank 0's and rank 1's shares of 128 indices each, from seeds 0 and 1: computed with torch's own sampler.
        expected = set(DistributedSampler(range(512), num_replicas=4, rank=0, seed=0)) & set(
            DistributedSampler(range(512), num_replicas=4, rank=1, seed=1)
        )
        # Rank 0's and rank 1's shares are all that is compared: what no rank reads is not claimed.
        assert _measured(f) == {"indices_read_twice": len(expected), "epoch": 0} and len(expected) > 0, f


def test_samplers_built_for_one_replica_explain_the_identical_inputs(tmp_path) -> None:
    for found in run_ranks(_train, tmp_path, args=("one_replica",)):
        assert set(found) == {"shards-overlap", "identical-inputs-across-ranks"}, found
        f = found["shards-overlap"]
        assert f["ranks"] == [0, 1], f
        assert _measured(f) == {"indices_read_twice": 512, "epoch": 0, "indices_unread": 0}, f
        assert found["identical-inputs-across-ranks"]["caused_by"] == ["shards-overlap"]


def test_a_loader_without_a_distributed_sampler_over_one_dataset_is_named(tmp_path) -> None:
    """Ground truth under plain torchrun (2 ranks, `DataLoader(ds, batch_size=16, shuffle=True)` over one 512-sample
    TensorDataset after `torch.manual_seed(1234 + rank)`): exit 0, nothing printed; each rank runs 32 steps per epoch
    over all 512 samples in its own order, so the ranks' batches differ and `identical-inputs-across-ranks` cannot
    see it. Before, `check` said "No problems found"."""
    for found in run_ranks(_train, tmp_path, world_size=4, args=("whole_random",)):
        assert set(found) == {"shards-overlap"}, found
        f = found["shards-overlap"]
        assert f["ranks"] == [0, 1, 2, 3] and _measured(f) == {}, f  # two ranks' datasets compared, not all four
        assert "RandomSampler" in f["title"], f
    for found in run_ranks(_train, tmp_path, args=("whole_sequential",)):
        # In one order on every rank: the same batches, explained by the whole dataset on every rank.
        assert set(found) == {"shards-overlap", "identical-inputs-across-ranks"}, found
        assert _measured(found["shards-overlap"]) == {"ranks_reading_whole_dataset": 2}
        assert found["identical-inputs-across-ranks"]["caused_by"] == ["shards-overlap"]


@pytest.mark.parametrize("pattern", ["same_seed", "default", "own_data"])
def test_samplers_that_agree_say_nothing(tmp_path, pattern) -> None:
    for found in run_ranks(_train, tmp_path, args=(pattern,)):
        assert found == {}, found


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_check_names_the_samplers_under_ddp_and_fsdp2_alike(tmp_path, wrap) -> None:
    """Through `ddp-doctor check`, the same rule on both roads: a seed per rank at 4 ranks (rank 0 and the first
    other rank compared), and a clean neighbour."""
    script = SCRIPTS / "shards_sampler.py"
    run = check(["--nproc-per-node", "4", str(script), "--wrap", wrap, "--sampler", "seed-per-rank"], tmp_path)
    f = run.finding("shards-overlap")
    assert f["ranks"] == [0, 1, 2, 3] and f["sites"] == [
        f"tests/scripts/shards_sampler.py:{line_of(script, 'sampler=sampler)')}"
    ], f
    # The epoch the report read the samplers in: the first (DDP's observed steps) or the second (FSDP2's report
    # comes after the epoch end it followed).
    epoch = int(_measured(f)["epoch"])
    shares = []
    for rank in (0, 1):
        sampler = DistributedSampler(range(512), num_replicas=4, rank=rank, seed=rank)
        sampler.set_epoch(epoch)
        shares.append(set(sampler))
    assert _measured(f)["indices_read_twice"] == len(shares[0] & shares[1]) > 0, f
    whole = check(["--nproc-per-node", "2", str(script), "--wrap", wrap, "--sampler", "whole"], tmp_path / "whole")
    f = whole.finding("shards-overlap")
    assert f["ranks"] == [0, 1] and _measured(f) == {"ranks_reading_whole_dataset": 2}, f
    assert f["sites"] == [f"tests/scripts/shards_sampler.py:{line_of(script, 'batch_size=16, shuffle=True)')}"], f
    clean = check(["--nproc-per-node", "2", str(script), "--wrap", wrap, "--sampler", "same"], tmp_path / "clean")
    assert "shards-overlap" not in clean.codes and clean.errors() == [], clean.output


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_random_split_drawn_per_rank_is_named_and_a_seeded_one_is_clean(tmp_path, wrap) -> None:
    """`torch.manual_seed(rank)` at the start, then `random_split(ds, [0.8, 0.2])` from the global generator: each
    rank's DistributedSampler samples its own 410-sample train split. Ground truth under plain torchrun (2 ranks):
    exit 0, the two ranks' train splits share 329 of their 410 indices, so some samples train twice per epoch,
    others never, and each rank's validation split holds samples the other trains on. The samplers' settings agree;
    the datasets they sample do not. Before, "No problems found"."""
    script = SCRIPTS / "shards_sampler.py"
    run = check(["--nproc-per-node", "2", str(script), "--wrap", wrap, "--sampler", "split-per-rank"], tmp_path)
    f = run.finding("shards-overlap")
    assert f["ranks"] == [0, 1] and f["sites"] == [
        f"tests/scripts/shards_sampler.py:{line_of(script, 'sampler=sampler)')}"
    ]
    assert "indices_read_twice" not in _measured(f), f  # no index overlap to compute over two different subsets
    clean = check(["--nproc-per-node", "2", str(script), "--wrap", wrap, "--sampler", "split-seeded"], tmp_path / "c")
    assert "shards-overlap" not in clean.codes and clean.errors() == [], clean.output


@pytest.mark.parametrize("ranks", [4, 2])
def test_a_sampler_built_from_the_data_parallel_mesh_beside_tensor_parallelism_says_nothing(tmp_path, ranks) -> None:
    """FSDP2 over tensor parallelism on a [2, 2] mesh: each sampler holds the data-parallel rank and degree (2), not
    the world's (4). Whether a sampler is its rank's own is not judged on a mesh smaller than the world; its
    settings are still compared. On 2 ranks the mesh is [1, 2]: one tensor-parallel pair, whose ranks rightly read
    the same batches (not `identical-inputs-across-ranks`)."""
    run = check(["--nproc-per-node", str(ranks), str(SCRIPTS / "fsdp2_tp_sampler.py")], tmp_path)
    assert run.codes == set(), run.output
    assert run.report["compared"]["samplers"] is True and run.report["compared"]["batches_drawn"] > 0, run.report
    # The inputs within each tensor-parallel pair were compared; what is not compared on such a mesh is said.
    assert run.report["compared"]["inputs_within_groups"] > 0 and run.report["compared"]["group_dims"] == ["tp"]
    assert run.report["sharding"]["beside"] == {"dims": ["tp"], "size": 2}, run.report["sharding"]
    assert any(f"{ranks // 2}-rank mesh" in line for line in run.report["unchecked"]), run.report["unchecked"]


def test_tensor_parallel_pairs_reading_different_batches_are_named(tmp_path) -> None:
    """The same job with its DistributedSampler built from the world (4 replicas), not the data-parallel mesh (2).
    Ground truth under plain torchrun: ranks 0 and 1 start on different batches (first inputs 0.85 and -0.87),
    report different losses for the one forward they compute together (1.445 and 1.319 at the first step), and
    take 8 steps per epoch instead of 16; exit 0, no warning."""
    script = SCRIPTS / "fsdp2_tp_sampler.py"
    run = check(["--nproc-per-node", "4", str(script), "--sampler", "world"], tmp_path)
    f = run.finding("tp-inputs-differ")
    assert f["severity"] == "error" and f["ranks"] == [0, 1, 2, 3] and f["steps"], f
    assert f["sites"] == [f"tests/scripts/fsdp2_tp_sampler.py:{line_of(script, 'loader = DataLoader(')}"], f
    measured = {m["name"]: m["value"] for m in f["measured"]}
    assert measured["groups_with_different_inputs"] == 2 and measured["steps_with_different_inputs"] == len(f["steps"])
    assert run.errors() == ["tp-inputs-differ"], run.codes
