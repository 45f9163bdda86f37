"""Probes on FSDP2's own collectives, installed by wrapping each sharded group's communication objects: the dtype
its reduce-scatter runs in and what a low one costs (`ReducePrecisionProbe`: a second, float32 reduce-scatter of one
backward's gradients, made on every rank alike), and its all-gathers per step (`GatherCount`). Private objects of
FSDP2, read and wrapped, never relied on: where they are missing, the probes see nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.observation.sharding import LOW_DTYPES, ShardedModel, fsdp_groups

__all__ = ["GatherCount", "ReducePrecisionProbe"]


class ReducePrecisionProbe:
    """Sees the dtype FSDP2 reduces one backward's gradients in, and measures what a low one costs: each sharded
    group's reduce-scatter of a bfloat16 or float16 input also runs on the same input in float32, and the two
    results are compared.

    Installed around FSDP2's private `_reduce_scatter_comm` of each parameter group (2.10 and later; the probe
    does nothing where that is missing), on every rank alike, so the extra collective pairs up across ranks. What is
    measured is the reduction's own rounding: the cast of float32 gradients to the reduce dtype before it (where the
    compute dtype is float32) is not in the number. The float32 reduce-scatter is `reference`, the exchange's
    (`ddp_doctor.exchange.shard_collectives.reduce_scatter_in_float32`): observation communicates through it only."""

    def __init__(self, model: ShardedModel, reference: Callable[..., torch.Tensor]) -> None:
        self.reference = reference
        self._groups = [g for g in model.param_groups() if hasattr(g, "_reduce_scatter_comm")]
        self._saved: list[tuple[Any, Any]] = []
        self.worst_abs = 0.0
        self.diff_sum = 0.0
        self.ref_sum = 0.0
        self.calls = 0
        """Reduce-scatters seen, in any dtype."""
        self.low_calls = 0
        """Those of a bfloat16 or float16 input, measured."""
        self.low_dtype: torch.dtype | None = None

    def install(self) -> None:
        for group in self._groups:
            wrapper = _MeasuredReduceScatter(group._reduce_scatter_comm, self)
            group._reduce_scatter_comm = wrapper
            self._saved.append((group, wrapper))

    def remove(self) -> None:
        for group, wrapper in self._saved:
            _unwrap(group, "_reduce_scatter_comm", wrapper)
        self._saved.clear()

    def note(self, low: torch.Tensor, reference: torch.Tensor) -> None:
        diff = (low.float() - reference).abs()
        self.worst_abs = max(self.worst_abs, float(diff.max())) if diff.numel() else self.worst_abs
        self.diff_sum += float(diff.double().sum())
        self.ref_sum += float(reference.double().abs().sum())
        self.low_calls += 1
        self.low_dtype = low.dtype

    @property
    def mean_relative(self) -> float:
        return self.diff_sum / self.ref_sum if self.ref_sum > 0 else 0.0


def _unwrap(group: Any, attr: str, wrapper: _WrappedComm) -> None:
    """Take `wrapper` out of the group's `attr`, wherever it sits in a chain of wrappers (a check's watch and an
    `observe()` in its script each wrap FSDP2's comms; the one that leaves first must keep the other's)."""
    if getattr(group, attr, None) is wrapper:
        setattr(group, attr, wrapper._inner)
        return
    outer = getattr(group, attr, None)
    while isinstance(outer, _WrappedComm):
        if outer._inner is wrapper:
            outer._inner = wrapper._inner
            return
        outer = outer._inner


class _WrappedComm:
    """One of FSDP2's communication objects (`Comm`: `allocate`, then a call), wrapped: its buffers are its own."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._inner.allocate(size, dtype=dtype, device=device)


class _MeasuredReduceScatter(_WrappedComm):
    """FSDP2's reduce-scatter as it was, then the same input reduced in float32 (when it is a low dtype)."""

    def __init__(self, inner: Any, probe: ReducePrecisionProbe) -> None:
        super().__init__(inner)
        self._probe = probe

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        work = self._inner(
            output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op
        )
        self._probe.calls += 1
        if input_tensor.dtype in LOW_DTYPES:
            if work is not None:
                work.wait()
                work = None
            reference = self._probe.reference(output_tensor, input_tensor, op, group)
            self._probe.note(output_tensor, reference)
        return work


class GatherCount:
    """How many all-gathers FSDP2 makes (each sharded group's `_all_gather_comm`, wrapped to count its calls; a
    group without one, before 2.10, is not counted), and which non-root sharded module ran its forward last (a
    forward pre-hook on each): the module whose backward comes first, so with `reshard_after_forward=True` its
    parameters are freed after its forward and all-gathered again at once. Local; nothing here communicates."""

    def __init__(self, model: ShardedModel) -> None:
        self.calls = 0
        self.last_forward: str | None = None
        self.counted = False
        self.frozen = False
        """Set at the observed steps' end: the forwards of an epoch end the check follows (an evaluation) do not
        move `last_forward`."""
        self._undo: list[Any] = []
        for name, module in model.sharded:
            for group in fsdp_groups(module):
                comm = getattr(group, "_all_gather_comm", None)
                if comm is not None:
                    group._all_gather_comm = wrapper = _CountedAllGather(comm, self)
                    self._undo.append(functools.partial(_unwrap, group, "_all_gather_comm", wrapper))
                    self.counted = True
            if name:
                self._undo.append(module.register_forward_pre_hook(functools.partial(self._forward, name)).remove)

    def remove(self) -> None:
        """Put FSDP2's all-gathers back and take the forward hooks off (the counts stay)."""
        self.frozen = True
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _forward(self, name: str, _module: Any, _args: Any) -> None:
        if self.frozen or _in_backward():
            return  # activation checkpointing recomputes forwards in backward, first block last: not the forward
        self.last_forward = name


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward recomputed by activation
    checkpointing); False where the private call is missing."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class _CountedAllGather(_WrappedComm):
    """FSDP2's all-gather as it was, counted."""

    def __init__(self, inner: Any, count: GatherCount) -> None:
        super().__init__(inner)
        self._count = count

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._count.calls += 1
        return self._inner(*args, **kwargs)
