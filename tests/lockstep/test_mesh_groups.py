"""The ranks that must read the same batches beside a sharded model's data-parallel mesh
(`observation/mesh_groups.py`), read from the mesh the DTensor parameters live on, for the meshes of FSDP2 over
tensor parallelism that real jobs build: HSDP beside tensor parallelism on 8 ranks, and torchtitan's flattened
data-parallel mesh (`dp_shard` and `cp` flattened to `dp_shard_cp`). Each case runs one rank of an 8-rank group on
torch's `fake` backend (no collective moves data; DeviceMesh, DTensor and `fully_shard` build as in a real job), in
a fresh process, which may hold one default group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_SCRIPT = """
import json, sys
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from ddp_doctor.observation.mesh_groups import beside_group

layout, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
names = ("replicate", "shard", "tp") if layout == "hsdp" else ("dp_shard", "cp", "tp")
mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
data = mesh["replicate", "shard"] if layout == "hsdp" else mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
if layout == "no-tp":  # the same model without tensor parallelism: nothing beside the mesh
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
fully_shard(model, mesh=data)
found = beside_group(list(model.parameters()), data, rank)
print(json.dumps(None if found is None else [found.index, found.groups, found.members, found.dims]))
"""

PAIRS = [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    ("layout", "rank", "expected"),
    [
        ("hsdp", 0, [0, 4, PAIRS, ["tp"]]),
        ("hsdp", 5, [2, 4, PAIRS, ["tp"]]),
        ("flattened", 7, [3, 4, PAIRS, ["tp"]]),
        ("no-tp", 3, None),
    ],
)
def test_the_tensor_parallel_groups_are_read_from_the_parameters_mesh(layout: str, rank: int, expected) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, layout, str(rank)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected
