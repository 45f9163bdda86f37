"""The user's lines that converted or materialised a module's tensors in this process: `nn.Module._apply` (a
`.to(dtype)`, `.half()`, `.cuda()` after DDP was built gives the parameters new gradient accumulators, which DDP's
hooks are not on) and `nn.Module.to_empty()` (storage that holds whatever memory held, to be initialised after)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ddp_doctor.core.frames import user_site

__all__ = ["CAST_SITES", "TO_EMPTY_SITES", "listen_casts", "listen_to_empty"]

TO_EMPTY_SITES: list[str] = []
"""Where the script called `nn.Module.to_empty()` (a model built on the meta device materialised with storage that
holds whatever memory held: its parameters must be initialised after), once `listen_to_empty` ran."""


CAST_SITES: list[str] = []
"""Where the script converted a module's tensors (`nn.Module._apply`: `.to(dtype)`, `.half()`, `.bfloat16()`,
`.cuda()`), outermost calls only, in order (at most 64), once `listen_casts` ran."""
_CASTING = [0]


def listen_casts() -> None:
    """Remember the user's line of each conversion of a module's tensors in this process (once). A parameter whose
    dtype or device changes gets a new gradient accumulator, and DDP's hooks stay on the old one."""
    if getattr(nn.Module._apply, "_ddp_doctor", False):
        return
    original = nn.Module._apply

    def _apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not _CASTING[0] and len(CAST_SITES) < 64:
            CAST_SITES.append(user_site() or "an unknown place")
        _CASTING[0] += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _CASTING[0] -= 1

    _apply._ddp_doctor = True  # type: ignore[attr-defined]
    nn.Module._apply = _apply  # type: ignore[method-assign]


def listen_to_empty() -> None:
    """Remember the user's line of each `nn.Module.to_empty()` call in this process (once; at most 8)."""
    if getattr(nn.Module.to_empty, "_ddp_doctor", False):
        return
    original = nn.Module.to_empty

    def to_empty(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if len(TO_EMPTY_SITES) < 8:
            site = user_site() or "an unknown place"
            if site not in TO_EMPTY_SITES:
                TO_EMPTY_SITES.append(site)
        return original(self, *args, **kwargs)

    to_empty._ddp_doctor = True  # type: ignore[attr-defined]
    nn.Module.to_empty = to_empty  # type: ignore[method-assign]
