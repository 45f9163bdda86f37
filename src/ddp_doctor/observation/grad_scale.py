"""By how much each rank's gradient shards change between the end of the backward and the optimizer step: the
invariant that gradient clipping scales every rank's shards of a sharded model by the same coefficient.

At the end of each backward through the model (a callback on autograd's engine, queued again from the end of the
engine's queue so that it runs after FSDP2's own end-of-backward callbacks, which wait for the reduce-scatters and
set the sharded gradients), this rank's gradient shards' squared norm is taken; at the optimizer step it is
taken again. Their ratio is this rank's scale: the same on every rank for any clipping of the global norm
(`clip_grad_norm_` on DTensor gradients, or none), different where each rank scaled its shards by a coefficient of
its own (a norm from `.to_local()`). With gradient accumulation the last backward before the step counts. Local;
nothing here communicates: the ranks' scales are compared by the sharded report.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.core.compat import is_dtensor
from ddp_doctor.observation.hooks import tensors_in
from ddp_doctor.observation.sharding import ShardedModel

__all__ = ["GradScale"]


class GradScale:
    """Per observed step, the squared norm of this rank's gradient shards at the optimizer step over the same at the
    end of the step's last backward (`ratios`: None for a step it could not measure)."""

    def __init__(self, model: ShardedModel, steps: int) -> None:
        self._model = model
        self._steps = steps
        """The steps it measures; then it takes its hook off (nothing more is compared)."""
        self._handle: Any = None
        self._after_backward: float | None = None
        self.ratios: list[float | None] = []
        self.norms: list[float | None] = []
        """Per observed step, the squared norm of this rank's gradient shards at the optimizer step (None: no
        sharded gradient): zero everywhere is a loss that gives no gradient; NaN or infinity, a broken step."""

    def install(self) -> None:
        self._handle = self._model.root.register_forward_hook(self._on_forward)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _on_forward(self, _module: Any, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        out = next((t for t in tensors_in(output) if t.requires_grad), None)
        if out is not None:
            out.register_hook(self._on_backward_start)

    def _on_backward_start(self, _grad: torch.Tensor) -> None:
        self._queue(self._queue_last)

    def _queue_last(self) -> None:
        # Run again from the end of the queue: by now every callback the backward queued is ahead of this one,
        # FSDP2's included (each sharded module that is a root of its own, under an unsharded root, queues one
        # when the backward reaches it, after this model's output), and the engine runs callbacks queued while
        # it runs them.
        self._queue(self._on_backward_end)

    def _queue(self, callback: Callable[[], None]) -> None:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(callback)
        except Exception:  # a private API: without it this step is not measured
            self._after_backward = None

    def _on_backward_end(self) -> None:
        self._after_backward = self._shards_squared()

    def _shards_squared(self) -> float | None:
        """The squared norm of this rank's shards of the sharded parameters' gradients (DTensors); None when there
        are none. A plain parameter's gradient is left out: no reduction set it (`unsharded-params-not-synced`)."""
        local = [p.grad.to_local() for _, p in self._model.named_parameters() if is_dtensor(p.grad)]
        if not local:
            return None
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in local])
        return float(torch.linalg.vector_norm(norms)) ** 2

    def on_step(self) -> None:
        """The optimizer is about to step: this step's ratio, when its last backward was measured. After `steps`
        steps the hook comes off and nothing more is measured."""
        if len(self.ratios) >= self._steps:
            return
        after, at_step = self._after_backward, self._shards_squared()
        self.ratios.append(at_step / after if after and at_step is not None else None)
        self.norms.append(at_step)
        self._after_backward = None
        if len(self.ratios) >= self._steps:
            self.remove()
