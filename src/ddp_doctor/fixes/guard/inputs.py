"""The guard's data checks: a shuffling DistributedSampler whose epoch did not advance (local, logged once), and the
training DataLoader's batches per epoch, compared across ranks inside the scheduled replica comparison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.analyze import rules
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import named_ranks
from ddp_doctor.exchange.replicas import Difference, Entry
from ddp_doctor.fixes.guard.problems import Reporter
from ddp_doctor.observation import dataloaders

__all__ = ["BATCHES", "DataWatch"]

BATCHES = "batches per epoch of the training DataLoader"
"""The name of the comparison row that carries `len(loader)`."""


class DataWatch:
    """Follows the DataLoaders the loop iterates while guarded (through `observation.dataloaders`, local only)."""

    def __init__(self, reporter: Reporter, rank: int) -> None:
        self._reporter = reporter
        self._rank = rank
        self._epochs: dict[int, Any] = {}
        """id(loader) -> the sampler epoch its last iteration started with."""
        self.batches: int | None = None
        """`len()` of the first loader iterated that has one (the training loop's, in practice)."""
        self._stop: Callable[[], None] | None = dataloaders.listen(self._on_loader)

    def close(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    def _on_loader(self, info: dict[str, Any]) -> None:
        if self.batches is None and info.get("batches") is not None:
            self.batches = int(info["batches"])
        if info.get("sampler") != "DistributedSampler" or not info.get("shuffle"):
            return
        epoch, key = info.get("epoch"), info["id"]
        if key in self._epochs and epoch is not None and self._epochs[key] == epoch:
            self._reporter.report(
                [
                    rules.sampler_epoch_repeated(
                        epoch=epoch, ranks=[self._rank], site=f"created at {info['site']}" if info.get("site") else None
                    )
                ],
                key=("sampler-epoch", key),
            )
        self._epochs[key] = epoch

    def entry(self) -> Entry:
        """The comparison row: this rank's batches per epoch (absent until a loader with a length was seen)."""
        value = None if self.batches is None else torch.tensor([float(self.batches)], dtype=torch.float64)
        return Entry(BATCHES, "data", 1, value)

    def findings(self, differences: list[Difference], step: int) -> list[Finding]:
        """`uneven-inputs` when the rows of `differences` say the ranks' batch counts differ."""
        if not differences:
            return []
        d = differences[0]
        return [
            rules.uneven_inputs(
                title=f"{named_ranks(d.ranks, d.more_ranks, prefix='ranks')} have a different number of batches per epoch "
                f"than rank {d.reference_rank}",
                cause=f"The training DataLoader gives rank {self._rank} {self.batches} batches per epoch, and "
                f"{named_ranks(d.ranks, d.more_ranks)} a different number, so some rank runs out first while the "
                "others still train",
                ranks=sorted({d.reference_rank, *d.ranks}),
                steps=[step],
            )
        ]
