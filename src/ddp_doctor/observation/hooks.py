"""Plumbing for the doctor's hooks: tensors inside outputs, hooks that a copied or pickled model does not drag along,
and the listener list every process-wide probe keeps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Hook", "ListenerList", "tensors_in"]


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
