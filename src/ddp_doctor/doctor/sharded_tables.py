"""What the sharded report reads of the watch of the model's steps (`ShardedWatch`), and this rank's tables for the
sharded exchange (`exchange/sharded_protocol.py`'s `ShardedRecord`) from it: its buffers, its replicated tensors per
step, the first observed steps' measures; and the per-step measures the watch takes of the model (`replica_sum`,
`nonzero_grads`)."""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddp_doctor.core.compat import is_dtensor
from ddp_doctor.core.fingerprint import fingerprints_batched, significant
from ddp_doctor.core.sharded_run import INPUT_STEPS
from ddp_doctor.exchange.sharded_protocol import NOBODY, STEP_COLUMNS, STEP_SHIFT
from ddp_doctor.observation.grad_scale import GradScale
from ddp_doctor.observation.graph_collectives import GraphCollectives
from ddp_doctor.observation.shard_comms import GatherCount, ReducePrecisionProbe
from ddp_doctor.observation.sharding import ShardedModel
from ddp_doctor.observation.step_clock import StepClock
from ddp_doctor.report.model import RunFacts

__all__ = [
    "ShardedWatch",
    "buffer_table",
    "first_nonfinite_input",
    "nonzero_grads",
    "replica_steps",
    "replica_sum",
    "step_table",
]


class ShardedWatch(Protocol):
    """What the report reads of the watch that followed the sharded model's steps (`PlainOptimizerWatch`)."""

    optimizer: torch.optim.Optimizer | None
    others: MutableMapping[torch.optim.Optimizer, bool]
    steps: int
    framework: str
    frozen: bool
    sync_off_steps: int
    shard_saves: list[dict[str, Any]]
    weights_at_first: torch.Tensor | None
    buffers_at_first: torch.Tensor | None
    grad_seen: torch.Tensor | None
    grad_nonzero: torch.Tensor | None
    grad_steps: int
    graded_outside: set[int]
    gathers: GatherCount | None
    gathers_per_step: list[int]
    input_fps: list[torch.Tensor | None]
    replica_state: list[tuple[int, str, int, dict[str, Any]]]
    replica_sums: list[float]
    drawn: list[int]
    grad_scale: GradScale | None
    graph: GraphCollectives
    probe: ReducePrecisionProbe | None
    clock: StepClock | None
    in_process: bool
    """Following for `observe()`, which sees no `fully_shard` call and names no failure of the run; False for
    `ddp-doctor check`."""

    def stepped_params(self) -> list[torch.Tensor]: ...

    def facts(self, *, sharding: dict[str, Any] | None = None) -> RunFacts: ...


def buffer_table(w: ShardedWatch, buffers: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """float64[B, 3]: each buffer's fingerprint and whether it changed since the first observed step."""
    if not buffers:
        return torch.zeros(0, 3, dtype=torch.float64)
    now = fingerprints_batched(b for _, b in buffers).nan_to_num(0.0)
    first = w.buffers_at_first
    moved = (
        (now != first.nan_to_num(0.0)).any(-1)
        if first is not None and first.shape == now.shape
        else torch.zeros(len(buffers), dtype=torch.bool)
    )
    return torch.cat([now, moved.double()[:, None]], dim=1)


def replica_steps(sums: list[float]) -> torch.Tensor:
    """`ShardedRecord.replica_steps`: per observed step, the replicated tensors' fingerprint sum and 1 where the
    step was measured."""
    table = torch.zeros(INPUT_STEPS, 2, dtype=torch.float64)
    for k, total in enumerate(sums[:INPUT_STEPS]):
        table[k] = torch.tensor([total, 1.0], dtype=torch.float64)
    return table


def step_table(w: ShardedWatch) -> torch.Tensor:
    """The first `INPUT_STEPS` observed steps' measures, as `sharded_protocol.STEP_COLUMNS` says: the training
    inputs' fingerprints, the gradient shards' scale from the backward's end to the step (`GradScale.ratios`), their
    norm at the step (`GradScale.norms`), the digests of the optimizer's settings, of the modules' modes and of the
    script's collectives, and the batches the training loader handed out, each measure with a presence column."""
    table = torch.zeros(INPUT_STEPS, STEP_COLUMNS, dtype=torch.float64)
    for k, fp in enumerate(w.input_fps[:INPUT_STEPS]):
        if fp is not None:
            table[k, 0:3] = torch.tensor([*fp[:2].double().nan_to_num(0.0, 0.0, 0.0).tolist(), 1.0])
    scale = w.grad_scale
    for k, ratio in enumerate(scale.ratios[:INPUT_STEPS] if scale is not None else []):
        if ratio is not None and math.isfinite(ratio) and ratio > 0:
            table[k, 3:5] = torch.tensor([ratio, 1.0])
    for k, sq in enumerate(scale.norms[:INPUT_STEPS] if scale is not None else []):
        if sq is not None:
            table[k, 5:8] = torch.tensor([sq, 0.0, 1.0] if math.isfinite(sq) else [0.0, 1.0, 1.0])
    for k, (settings, _, modes, _) in enumerate(w.replica_state[:INPUT_STEPS]):
        table[k, 8:11] = torch.tensor([float(settings), float(modes), 1.0])
    for k, (calls, _, _) in enumerate(w.step_collectives[:INPUT_STEPS]):
        table[k, 11] = float(calls)
    for k, drawn in enumerate(w.drawn[:INPUT_STEPS]):
        table[k, 12] = float(drawn)
    return table


def first_nonfinite_input(w: ShardedWatch) -> float:
    """The `inputs_nonfinite` slot: the first observed step whose training inputs held NaN or infinity on this rank,
    with the rank (`sharded_protocol.STEP_SHIFT`), or `NOBODY`."""
    step = next((k for k, fp in enumerate(w.input_fps[:INPUT_STEPS]) if fp is not None and fp[2] > 0), None)
    return NOBODY if step is None else float(step * STEP_SHIFT + dist.get_rank())


def replica_sum(model: ShardedModel) -> float:
    """The sum of the fingerprints of this rank's local tensors of the model's replicated (DTensor) parameters."""
    local = [p for _, p in model.named_parameters() if is_dtensor(p)]
    return float(fingerprints_batched(local).nan_to_num(0.0).sum()) if local else 0.0


def nonzero_grads(model: ShardedModel) -> torch.Tensor:
    """bool[P]: per parameter of `model`, this rank's shard of its gradient holds a value other than 0, beyond
    round-off (`significant`; one copy to the host for all of them)."""
    peaks = []
    for _, p in model.named_parameters():
        grad = p.grad
        local = grad.to_local() if grad is not None and is_dtensor(grad) else grad
        if local is None or local.numel() == 0:
            peaks.append(torch.zeros((), device=p.device))
        else:
            peaks.append(local.detach().abs().amax().float())
    return (
        significant(torch.stack([t.to(peaks[0].device) for t in peaks]).cpu())
        if peaks
        else torch.zeros(0, dtype=torch.bool)
    )
