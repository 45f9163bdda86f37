"""The autograd-graph walk from DDP's forward outputs: which parameters `find_unused_parameters=True` would see."""

from __future__ import annotations

from typing import Any

from ddp_doctor.observation.hooks import tensors_in

__all__ = ["walk_graph"]


def walk_graph(output: Any, index: dict[int, int]) -> tuple[set[int], int]:
    """Parameters reachable from the autograd graph of `output`, and the number of reentrant checkpoints in it.

    Args:
        output: what DDP's forward returned (any nesting of tensors).
        index: `id(parameter)` -> the parameter's position in the model's `named_parameters()`.

    Returns:
        ``(positions of reachable parameters, count of CheckpointFunctionBackward nodes)``. A parameter used but
        not reachable was used outside DDP's forward, or inside reentrant checkpointing, whose nodes hide their
        inner graph until backward.
    """
    stack = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
    seen: set[Any] = set()
    reachable: set[int] = set()
    checkpoints = 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:  # an AccumulateGrad node: a leaf tensor
            i = index.get(id(variable))
            if i is not None:
                reachable.add(i)
            continue
        if type(fn).__name__ == "CheckpointFunctionBackward":
            checkpoints += 1
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return reachable, checkpoints
