"""The ranks that must read the same batches beside a sharded model's data-parallel mesh.

FSDP2 over tensor parallelism shards each parameter over a mesh of the data-parallel dimensions and the
tensor-parallel ones (`DTensor.device_mesh`, say [2, 2] named ("dp", "tp")), while `fully_shard` is given the
data-parallel ones alone. The ranks that differ only along the other dimensions compute one model replica's forward
together: they must read the same batches. Pipeline stages never show here (their parameters are not on one mesh).
"""

from __future__ import annotations

import torch

from ddp_doctor.core.beside import BesideGroup
from ddp_doctor.core.compat import is_dtensor

__all__ = ["beside_group"]


def beside_group(params: list[torch.Tensor], data_mesh: object, rank: int) -> BesideGroup | None:
    """This rank's group of ranks beside `data_mesh` (the mesh `fully_shard` was given), from the mesh the model's
    DTensor parameters live on; None where no parameter lives on a larger mesh, or the meshes cannot be read
    (unnamed dimensions, a flattened data-parallel mesh)."""
    try:
        data_names = list(getattr(data_mesh, "mesh_dim_names", None) or ())
        meshes = [p.device_mesh for p in params if is_dtensor(p) and p.device_mesh.ndim > len(data_names)]
        if not data_names or not meshes:
            return None
        mesh = meshes[0]
        names = list(mesh.mesh_dim_names or ())
        if not names or not set(data_names) <= set(names) or any(m != mesh for m in meshes):
            return None
        data = [names.index(n) for n in data_names]
        beside = [d for d in range(len(names)) if d not in data]
        table = mesh.mesh.permute(*data, *beside).reshape(-1, int(torch.tensor(mesh.mesh.shape)[beside].prod()))
        rows = [sorted(int(r) for r in row) for row in table.tolist()]
        index = next(i for i, row in enumerate(rows) if rank in row)
    except (AttributeError, RuntimeError, TypeError, ValueError, StopIteration):
        return None
    return BesideGroup(rank=rank, index=index, members=rows, dims=[names[d] for d in beside])
