"""`watch`'s replica comparison past the first steps: what a rank writes, and what the parent compares.

The whole road (a real 2-rank job whose rank 1 drifts) is in tests/watch/test_watch_drift.py; here the parts: the points a
rank writes from a real DDP model, and the parent's reading of points written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from checkrun import free_port
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.launch.watch_replicas import MIN_EVERY, SCHEMA, ReplicaPoints, ReplicaWatch, point_path


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _write(folder: Path, rank: int, step: int, prints: dict[str, list[float]], group: str | None = None) -> None:
    path = point_path(folder, rank, step)
    path.parent.mkdir(exist_ok=True)
    point = {"schema": SCHEMA, "step": step, "names": list(prints), "fingerprints": list(prints.values())}
    if group is not None:
        point["group"] = group
    path.write_text(json.dumps(point))


def test_a_rank_writes_its_ddp_parameters_at_multiples_of_its_interval_without_the_ignored_ones(
    tmp_path: Path, one_rank_group: None
) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["1.bias"])
    ddp = DistributedDataParallel(model)  # held as a script holds its model: the rank keeps only a weak reference
    points = ReplicaPoints(tmp_path, 0)
    points.add_model(ddp)
    for step in range(9, 2 * MIN_EVERY + 1):
        points.stepped(step)
    written = sorted(int(p.name.split(".")[1]) for p in (tmp_path / "replicas").glob("rank0.*.json"))
    assert written[0] == MIN_EVERY and all(s % MIN_EVERY == 0 for s in written), written
    point = json.loads(point_path(tmp_path, 0, MIN_EVERY).read_text())
    assert point["names"] == ["0.weight", "0.bias", "1.weight"]  # 1.bias: DDP leaves it to each rank
    assert len(point["fingerprints"]) == 3 and all(len(f) == 2 for f in point["fingerprints"])


def test_the_parent_compares_every_step_all_ranks_wrote_and_names_the_first_that_differs(tmp_path: Path) -> None:
    same = {"w": [1.0, 2.0], "b": [float("nan"), float("nan")]}  # NaN on every rank is the same value
    for rank in (0, 1, 2):
        _write(tmp_path, rank, 16, same)
        _write(tmp_path, rank, 32, same)
    _write(tmp_path, 0, 48, same)  # rank 0 ran ahead: 48 is not compared until every rank wrote it
    watch = ReplicaWatch(folder=tmp_path)
    assert watch.poll({0, 1, 2}) is None and watch.compared == [16, 32]
    _write(tmp_path, 1, 48, {"w": [1.0, 2.5], "b": same["b"]})
    _write(tmp_path, 2, 48, same)
    found = watch.poll({0, 1, 2})
    assert found is not None and (found.step, found.agreed_step) == (48, 32)
    assert found.params == ["w"] and found.differing == 1 and found.groups == [[0, 2], [1]]
    saved = json.loads((tmp_path / "replicas.json").read_text())
    assert saved["divergence"]["step"] == 48 and saved["compared_steps"] == [16, 32, 48]
    assert watch.poll({0, 1, 2}) is None  # said once


def test_a_parameter_some_ranks_hold_and_others_do_not_differs(tmp_path: Path) -> None:
    _write(tmp_path, 0, 16, {"w": [1.0, 2.0], "extra": [0.5, 0.5]})
    _write(tmp_path, 1, 16, {"w": [1.0, 2.0]})
    found = ReplicaWatch(folder=tmp_path).poll({0, 1})
    assert found is not None and found.params == ["extra"] and found.groups == [[0], [1]]
    assert found.agreed_step is None


def test_one_live_rank_is_not_compared(tmp_path: Path) -> None:
    _write(tmp_path, 0, 16, {"w": [1.0, 2.0]})
    watch = ReplicaWatch(folder=tmp_path)
    assert watch.poll({0}) is None and watch.compared == []


def test_hsdp_shards_are_compared_among_the_ranks_that_hold_the_same_one(tmp_path: Path) -> None:
    """Ranks 0 and 2 hold shard "0", ranks 1 and 3 shard "1" (a [2, 2] mesh): different values across shards are
    the design; a difference within one shard's replicas is a divergence, named with those ranks."""
    for rank in range(4):
        shard = str(rank % 2)
        _write(tmp_path, rank, 16, {"w": [float(rank % 2), 1.0]}, group=shard)
        _write(tmp_path, rank, 32, {"w": [float(rank % 2) + (0.5 if rank == 3 else 0.0), 1.0]}, group=shard)
    watch = ReplicaWatch(folder=tmp_path)
    d = watch.poll({0, 1, 2, 3})
    assert d is not None and d.step == 32 and d.agreed_step == 16 and d.params == ["w"] and d.groups == [[1], [3]]
