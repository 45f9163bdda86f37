"""Changes to the parameters that no optimizer made (local facts only).

Every in-place write to a tensor moves its version counter (`Tensor._version`): `optimizer.step()`,
`load_state_dict` (a `copy_` under `no_grad`), `p.data.mul_(...)`, an EMA copied back. `VersionWatch` keeps the
counters as the optimizer left them (or as DDP's constructor did) and says which moved before the next forward: a
few integer reads per step, no hashing. `listen` wraps `nn.Module.load_state_dict` once per process and passes
each call with its module and the user's line, so a change can be named by the line that made it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ddp_doctor.core.frames import user_site
from ddp_doctor.observation.hooks import ListenerList

__all__ = ["VersionWatch", "listen"]

Listener = Callable[[nn.Module, str | None], None]
_listeners: ListenerList[Listener] = ListenerList()
_state = {"installed": False, "inside": False}


class VersionWatch:
    """The parameters' version counters at the last mark, and which moved since."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list(params)
        self._versions = self._read()

    def _read(self) -> list[int]:
        return [p._version for p in self._params]

    def mark(self) -> None:
        """The parameters as they are now are the reference (after the optimizer's step, say)."""
        self._versions = self._read()

    def moved(self) -> list[int]:
        """Indices of the parameters written in place since the last mark; marks again."""
        now = self._read()
        moved = [i for i, (a, b) in enumerate(zip(self._versions, now)) if a != b]
        self._versions = now
        return moved


def _install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    original = nn.Module.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # The outermost call only: load_state_dict recurses through `_load_from_state_dict`, not through itself,
        # but a module may override it and call the parent's.
        if _listeners and not _state["inside"]:
            _state["inside"] = True
            try:
                return original(self, *args, **kwargs)
            finally:
                _state["inside"] = False
                site = user_site()
                for listener in list(_listeners):
                    listener(self, site)
        return original(self, *args, **kwargs)

    nn.Module.load_state_dict = load_state_dict  # type: ignore[method-assign]


def listen(listener: Listener) -> Callable[[], None]:
    """Call `listener(module, site)` after each outermost `load_state_dict`; returns the remover."""
    _install()
    return _listeners.add(listener)
