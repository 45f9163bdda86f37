"""Plumbing for the doctor's hooks: tensors inside outputs, hooks that a copied or pickled model does not drag along,
optimizer step hooks that can be let go of inside a step, and the listener list every process-wide probe keeps."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Hook", "ListenerList", "StepHooks", "tensors_in"]


def tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside nested lists, tuples, dicts (HF `ModelOutput` is one) and dataclasses."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from tensors_in(getattr(obj, name, None), depth + 1)


def _inert(*_args: Any, **_kwargs: Any) -> None:
    return None


class Hook:
    """A hook that calls back into the `Doctor`.

    A model copied or pickled while observed (an EMA copy, `torch.save(model)`) must not drag the doctor along or
    fail: the copy gets a no-op in its place, since nobody observes the copy.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_make_inert, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert


def _make_inert() -> Callable[..., None]:
    return _inert


T = TypeVar("T")


class ListenerList(list[T], Generic[T]):
    """A list of listeners whose `add` returns the function that removes the one added (idempotent)."""

    def add(self, listener: T) -> Callable[[], None]:
        self.append(listener)

        def remove() -> None:
            if listener in self:
                self.remove(listener)

        return remove


_OPTIMIZER_FILE = os.path.join("torch", "optim", "optimizer.py")
_pending: list[Any] = []
"""Handles of disarmed step hooks whose removal waits for a moment outside every optimizer step."""


def _inside_optimizer_step() -> bool:
    """Whether an `Optimizer.step` is running on this thread (its hook-running `wrapper` is on the stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "wrapper" and frame.f_code.co_filename.endswith(_OPTIMIZER_FILE):
            return True
        frame = frame.f_back
    return False


class StepHooks:
    """Optimizer step hooks (one optimizer's or every optimizer's) that may be let go of from inside a step.

    `Optimizer.step` runs its hooks by iterating the OrderedDicts that hold them, so removing one from inside a
    hook raises *OrderedDict mutated during iteration* in the user's `step()` whenever another hook comes after it
    (measured on torch 2.13: a hook registered after observe()'s, with `steps=1`). The observed steps end inside
    such a hook, and `bench` and the check stop their doctors there too. So `disarm` turns every hook here into a
    no-op at once, and `remove` takes them out only from outside any optimizer step; called inside one, it leaves
    them disarmed for the next `remove` of any `StepHooks` outside a step (or the `with` block's end) to take out."""

    def __init__(self) -> None:
        self._hooks: list[tuple[Hook, Any]] = []

    def add(self, register: Callable[[Callable[..., Any]], Any], fn: Callable[..., Any]) -> None:
        """Register `fn` with `register` (`optimizer.register_step_post_hook`, or torch's global
        `register_optimizer_step_post_hook`), wrapped in a `Hook`."""
        hook = Hook(fn)
        self._hooks.append((hook, register(hook)))

    def disarm(self) -> None:
        for hook, _ in self._hooks:
            hook.fn = _inert

    def remove(self) -> None:
        """Disarm every hook, and remove them (with any left disarmed before) unless an optimizer step is running."""
        self.disarm()
        _pending.extend(handle for _, handle in self._hooks)
        self._hooks.clear()
        if _inside_optimizer_step():
            return
        for handle in _pending:
            handle.remove()  # a no-op for a handle already removed
        _pending.clear()
