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
_pending: list[tuple[str, Any]] = []
"""("pre" or "post", handle) of disarmed step hooks whose removal waits until no step runs through that kind."""


def _busy_kinds() -> set[str]:
    """The kinds of step hooks ("pre", "post") whose dicts an `Optimizer.step` on this thread is iterating now: the
    hook-running `wrapper` of torch's optimizer.py on the stack, in its post-hook loop once `post_hook` is bound, and
    before that in its pre-hooks or its step ("pre", to be sure)."""
    busy: set[str] = set()
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wrapper" and code.co_filename.endswith(_OPTIMIZER_FILE):
            busy.add("post" if "post_hook" in frame.f_locals else "pre")
        frame = frame.f_back
    return busy


def _flush() -> None:
    """Remove the pending step hooks whose kind no running step iterates."""
    busy = _busy_kinds()
    keep = [(kind, handle) for kind, handle in _pending if kind in busy]
    for kind, handle in _pending:
        if kind not in busy:
            handle.remove()  # a no-op for a handle already removed
    _pending[:] = keep


class _StepHook(Hook):
    """A `Hook` that first removes the pending step hooks it may (a pre-hook call runs while the post hooks' dicts
    are still; a post-hook call while the pre hooks' are)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _pending:
            _flush()
        return self.fn(*args, **kwargs)


class StepHooks:
    """Optimizer step hooks (one optimizer's or every optimizer's) that may be let go of from inside a step.

    `Optimizer.step` runs its hooks by iterating the OrderedDicts that hold them, so removing one from inside a
    hook raises *OrderedDict mutated during iteration* in the user's `step()` whenever another hook comes after it
    (measured on torch 2.13: a hook registered after observe()'s, with `steps=1`). The observed steps end inside
    such a hook, and `bench` and the check stop their doctors there too. So `disarm` turns every hook here into a
    no-op at once, and `remove` takes out those whose dicts no running step iterates (the pre hooks, from a post
    hook); the others wait, disarmed, for the next step hook of any `StepHooks` or the next `remove` that may (the
    next step's pre hooks, the `with` block's end)."""

    def __init__(self) -> None:
        self._hooks: list[tuple[Hook, str, Any]] = []

    def add(self, kind: str, register: Callable[[Callable[..., Any]], Any], fn: Callable[..., Any]) -> None:
        """Register `fn` with `register` (`optimizer.register_step_post_hook`, or torch's global
        `register_optimizer_step_post_hook`, ...); `kind` is "pre" or "post", which of the two it registers."""
        hook = _StepHook(fn)
        self._hooks.append((hook, kind, register(hook)))

    def disarm(self) -> None:
        for hook, _, _ in self._hooks:
            hook.fn = _inert

    def remove(self) -> None:
        """Disarm every hook and remove those it may now (see the class)."""
        self.disarm()
        _pending.extend((kind, handle) for _, kind, handle in self._hooks)
        self._hooks.clear()
        _flush()
