"""Plumbing for the doctor's hooks: where in the user's code a call came from, tensors inside outputs, and hooks
that a copied or pickled model does not drag along."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Hook", "format_site", "tensors_in", "user_site"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OUR_DIR = os.path.dirname(__file__)


def format_site(filename: str, lineno: int) -> str:
    """`file:line`, the path relative to the working folder when it is inside it."""
    if filename.startswith(os.getcwd() + os.sep):
        filename = os.path.relpath(filename)
    return f"{filename}:{lineno}"


def user_site(skip_self: set[int] | None = None) -> str | None:
    """`file:line` of the innermost caller outside torch and ddp_doctor.

    Args:
        skip_self: ids of modules whose own methods are skipped too, so a bypass is reported where the user's
            trainer calls into the model, not inside the model's helper method.
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _OUR_DIR, "<")) and not (
                skip_self and "self" in frame.f_code.co_varnames and id(frame.f_locals.get("self")) in skip_self):
            return format_site(filename, frame.f_lineno)
        frame = frame.f_back
    return None


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
