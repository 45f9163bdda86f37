"""The one stack walker: which frames are the user's, the user's line (`file:line`), and which training framework
built the DDP model. Our own frames, torch's and the threading module's are never the user's; the frameworks'
(transformers, accelerate, lightning) are skipped where the user's own line is wanted (`frameworks=True`)."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "FRAMEWORKS",
    "format_site",
    "framework_of_stack",
    "is_user_frame",
    "user_call",
    "user_frame",
    "user_site",
    "user_site_of",
    "variable_names",
]

FRAMEWORKS = {
    "transformers": "transformers",
    "accelerate": "accelerate",
    "lightning": "lightning",
    "pytorch_lightning": "lightning",
}
"""Top-level package -> the framework name used in reports and recommendation snippets."""
_SKIP_DIRS = (
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(__file__)),
    os.path.dirname(threading.__file__),
)
"""torch, ddp_doctor (this file's grandparent folder) and the threading module."""


def format_site(filename: str, lineno: int) -> str:
    """`file:line`, the path relative to the working folder when it is inside it."""
    if filename.startswith(os.getcwd() + os.sep):
        filename = os.path.relpath(filename)
    return f"{filename}:{lineno}"


def _framework_dirs() -> dict[str, str]:
    """Where the imported frameworks live (a framework that built DDP has been imported)."""
    dirs = {}
    for package, name in FRAMEWORKS.items():
        module = sys.modules.get(package)
        if module is not None and getattr(module, "__file__", None):
            dirs[os.path.dirname(module.__file__) + os.sep] = name
    return dirs


def framework_of_stack(frames: list[traceback.FrameSummary]) -> str:
    """The outermost training framework on the stack (`torch` when none is).

    Outermost, because HF Trainer builds DDP through Accelerate: the user's idiom is the Trainer's.
    """
    dirs = _framework_dirs()
    for frame in frames:
        for prefix, name in dirs.items():
            if frame.filename.startswith(prefix):
                return name
    return "torch"


def is_user_frame(filename: str, *, frameworks: bool = True) -> bool:
    """Not torch's, ours or the threading module's, not `<string>`-like, and (with `frameworks`) no framework's."""
    skip = (*_SKIP_DIRS, "<", *_framework_dirs()) if frameworks else (*_SKIP_DIRS, "<")
    return not filename.startswith(skip)


def user_frame(frames: list[traceback.FrameSummary], *, code: bool = True) -> str | None:
    """`file:line  code` of the innermost frame in the user's own code (the path relative to the working folder)."""
    for frame in reversed(frames):
        if is_user_frame(frame.filename):
            return format_site(frame.filename, frame.lineno or 0) + (
                f"  {frame.line.strip()}" if code and frame.line else ""
            )
    return None


def user_site_of(
    frame: Any, limit: int | None = 40, *, frameworks: bool = True, skip_self: set[int] | None = None
) -> str | None:
    """`file:line` of the innermost user frame at or above `frame` (a cheap walk: no traceback objects).

    Args:
        frame: where the walk starts (a frame object).
        limit: frames walked at most (None: the whole stack).
        frameworks: skip the training frameworks' frames too.
        skip_self: ids of modules whose own methods are skipped as well, so a bypass is reported where the user's
            trainer calls into the model, not inside the model's helper method.
    """
    while frame is not None and limit != 0:
        code = frame.f_code
        if is_user_frame(code.co_filename, frameworks=frameworks) and not (
            skip_self and "self" in code.co_varnames and id(frame.f_locals.get("self")) in skip_self
        ):
            return format_site(code.co_filename, frame.f_lineno)
        frame = frame.f_back
        limit = None if limit is None else limit - 1
    return None


def user_site(skip_self: set[int] | None = None, *, frameworks: bool = False) -> str | None:
    """`file:line` of the innermost caller outside torch and ddp_doctor (framework code counts as the user's unless
    `frameworks`: then the script's own line that called into the framework)."""
    return user_site_of(sys._getframe(1), None, frameworks=frameworks, skip_self=skip_self)


def user_call(frame: Any) -> tuple[str | None, str]:
    """(`file:line` of the innermost caller outside torch, ddp_doctor and the training frameworks at or above `frame`,
    the name of the function that line called): the API the user called (`get_model_state_dict`, or a framework's
    `save_checkpoint`), whatever torch or the framework calls inside it."""
    called = frame.f_code.co_name if frame is not None else "?"
    while frame is not None:
        code = frame.f_code
        if is_user_frame(code.co_filename):
            return format_site(code.co_filename, frame.f_lineno), called
        called = code.co_name
        frame = frame.f_back
    return None, called


def variable_names(values: list[Any], frame: Any) -> dict[int, str]:
    """By identity, the name under which the script's innermost user frame at or above `frame` holds each of
    `values`: a local or global variable, an attribute of `self` (`self.log_temp`), or a parameter of a module one
    of them holds (`disc.0.weight`)."""
    wanted = {id(v) for v in values}
    while frame is not None and not is_user_frame(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return {}
    found: dict[int, str] = {}
    owner = frame.f_locals.get("self")
    places = [("", frame.f_globals), ("", frame.f_locals)]
    if owner is not None and isinstance(getattr(owner, "__dict__", None), dict):
        places.append(("self.", vars(owner)))
    for prefix, names in places:
        for name, value in list(names.items()):
            if name.startswith("_"):
                continue
            if id(value) in wanted:
                found[id(value)] = prefix + name
            elif isinstance(value, nn.Module) and not isinstance(value, DistributedDataParallel):
                # a module the script holds (not a DDP wrapper): its parameters by their names there
                for pname, p in _named(value):
                    if id(p) in wanted:
                        found.setdefault(id(p), f"{prefix}{name}.{pname}")
    return found


def _named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    try:
        return list(module.named_parameters())
    except Exception:  # a module of the script's whose attributes cannot be walked: it names nothing
        return []
