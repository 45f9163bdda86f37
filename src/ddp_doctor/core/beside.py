"""A rank's group of ranks beside a sharded model's data-parallel mesh (`observation/mesh_groups.py` finds it):
the ranks that compute one replica's forward together (a tensor-parallel group) and must read the same batches."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BesideGroup"]


@dataclass(frozen=True, slots=True)
class BesideGroup:
    """This rank's group of ranks beside the data-parallel mesh (a tensor-parallel group)."""

    rank: int
    """This rank (in the world)."""
    index: int
    """The group's data-parallel coordinate (flattened): one per group, 0 to `groups` - 1."""
    members: list[list[int]]
    """Every group's ranks, by `index` (world ranks, lowest first)."""
    dims: list[str]
    """The names of the dimensions beside the data-parallel ones."""

    @property
    def groups(self) -> int:
        return len(self.members)
