"""Which frames of a rank's stack are the user's, and which training framework built the DDP model."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

import torch

from ddp_doctor.hookutil import format_site

__all__ = ["FRAMEWORKS", "framework_of_stack", "is_user_frame", "user_frame", "user_site_of"]

FRAMEWORKS = {"transformers": "transformers", "accelerate": "accelerate", "lightning": "lightning",
              "pytorch_lightning": "lightning"}
"""Top-level package -> the framework name used in reports and recommendation snippets."""
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)),
              os.path.dirname(threading.__file__))


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


def is_user_frame(filename: str) -> bool:
    return not filename.startswith((*_SKIP_DIRS, "<", *_framework_dirs()))


def user_frame(frames: list[traceback.FrameSummary], *, code: bool = True) -> str | None:
    """`file:line  code` of the innermost frame in the user's own code (the path relative to the working folder)."""
    for frame in reversed(frames):
        if is_user_frame(frame.filename):
            return format_site(frame.filename, frame.lineno or 0) + (
                f"  {frame.line.strip()}" if code and frame.line else "")
    return None


def user_site_of(frame: Any, limit: int = 40) -> str | None:
    """`file:line` of the innermost user frame at or above `frame` (a cheap walk: no traceback objects)."""
    while frame is not None and limit:
        if is_user_frame(frame.f_code.co_filename):
            return format_site(frame.f_code.co_filename, frame.f_lineno)
        frame, limit = frame.f_back, limit - 1
    return None
