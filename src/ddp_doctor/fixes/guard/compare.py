"""The guard's replica comparison: every `every` optimizer steps (and on request), a per-tensor fingerprint of every
parameter, and of the buffers when DDP does not broadcast them, is compared across ranks with one small fixed-shape
all_reduce (`ddp_doctor.exchange.replicas`).

The step count is the optimizer's, which is the same on every rank, so every rank issues the collective at the same
point. A rank whose local part failed still takes part (`report_failure`), so every rank learns it and turns off
together instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.snippets import sync_batchnorm
from ddp_doctor.core.compat import ddp_syncs_buffers
from ddp_doctor.core.findings import Finding, ParamRef
from ddp_doctor.exchange.replicas import Comparison, Entry, compare_replicas, describe, local_rows, report_failure
from ddp_doctor.fixes.guard.inputs import DataWatch
from ddp_doctor.fixes.guard.problems import Reporter

__all__ = ["EXPLICIT", "ReplicaCheck", "due"]

EXPLICIT = ("check_now()", "before_save()")
"""Reasons of a comparison the user asked for: always reported, even when the same problem was reported before."""


def due(steps: int, every: int) -> bool:
    """True when a comparison is scheduled after `steps` steps (every rank computes the same answer)."""
    return steps > 0 and steps % every == 0


class ReplicaCheck:
    """Compares this rank's parameters (and unbroadcast buffers) with every other rank's."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        names: list[str],
        params: list[torch.nn.Parameter],
        buffer_names: list[str],
        group: dist.ProcessGroup | None,
        device: torch.device,
        data: DataWatch,
    ) -> None:
        self._ddp = ddp
        self._data = data
        self._names = names
        self._params = params
        self._buffer_names = buffer_names
        self._group = group
        self._device = device
        self.diverged: list[str] = []
        """Parameters that differed at the last comparison (what a state_dict() hook can warn about locally)."""

    def follow(self, ddp: DistributedDataParallel) -> None:
        self._ddp = ddp

    def entries(self) -> list[Entry]:
        # Buffers are compared only when DDP does not broadcast them in forward: otherwise rank 0's overwrite the
        # others' at the next forward, and BatchNorm statistics legitimately differ after a forward.
        sync_buffers = ddp_syncs_buffers(self._ddp)
        module = self._ddp.module
        entries = [Entry(n, "param", p.numel(), p) for n, p in zip(self._names, self._params)]
        for n in self._buffer_names:
            try:
                b = None if sync_buffers else module.get_buffer(n)
            except AttributeError:
                b = None
            entries.append(Entry(n, "buffer", b.numel() if b is not None else 0, b))
        entries.append(self._data.entry())  # one row, on every rank: the training loader's batches per epoch
        return entries

    def run(self, reporter: Reporter) -> Comparison | None:
        """One comparison. Collective: every rank calls it at the same step, whatever happened locally.

        A local failure (fingerprinting raised, or the guard is already broken on this rank) is sent through the
        same collective, so the returned `Comparison` names the failed ranks on every rank.

        Returns:
            The `Comparison` (identical on every rank), or None when the collective itself failed (peers gone or
            out of step): the guard must then turn off.
        """
        entries = self.entries()
        rows = None
        if not reporter.broken:
            try:
                rows = local_rows(entries)
            except Exception as exc:  # noqa: BLE001  (reported to every rank through the comparison)
                reporter.fail(exc)
        try:
            if rows is None:
                return report_failure(entries, group=self._group, device=self._device)
            return compare_replicas(entries, group=self._group, device=self._device, rows=rows)
        except Exception as exc:  # noqa: BLE001  (the collective failed: peers are gone or out of step)
            reporter.fail(exc)
            return None

    def findings(self, comparison: Comparison, reason: str, step: int) -> list[Finding]:
        """The divergence findings of `comparison` (identical on every rank), and remember what diverged."""
        findings = []
        params = comparison.of_kind("param")
        if params:
            findings.append(
                rules.replica_divergence(
                    title=f"weights of {len(params)} parameter(s) differ across ranks ({reason})",
                    detail=f"At {reason} the replicas are no longer identical:\n{describe(params)}\n"
                    "Whatever rank 0 saves is not what the other ranks trained.",
                    params=[ParamRef(d.name, d.numel, self._shape(d.name)) for d in params],
                    ranks=sorted({r for d in params for r in d.ranks} | {params[0].reference_rank}),
                    steps=[step],
                    rounding_only=all(d.rounding_only for d in params),
                    fix="find the cause (a bypassed wrapper, a requires_grad change after wrapping, rank-dependent "
                    "updates outside DDP); restart from a checkpoint saved before the divergence.",
                )
            )
        buffers = comparison.of_kind("buffer")
        if buffers:
            findings.append(
                rules.buffer_divergence(
                    title=f"{len(buffers)} buffer(s) differ across ranks ({reason})",
                    detail="DDP was built with broadcast_buffers=False (forward_sync_buffers=False), and these buffers "
                    f"differ:\n{describe(buffers)}\nEvaluation then differs by rank, and only rank 0's are saved.",
                    params=[ParamRef(d.name, d.numel) for d in buffers],
                    ranks=sorted({r for d in buffers for r in d.ranks} | {buffers[0].reference_rank}),
                    steps=[step],
                    fix="build DDP with broadcast_buffers=True (the default)"
                    + (f", or {sync}." if (sync := sync_batchnorm(self._ddp.device_type, "before wrapping")) else "."),
                )
            )
        findings += self._data.findings(comparison.of_kind("data"), step)
        self.diverged = [d.name for d in params]
        return findings

    def _shape(self, name: str) -> tuple[int, ...]:
        try:
            return tuple(self._params[self._names.index(name)].shape)
        except ValueError:
            return ()
