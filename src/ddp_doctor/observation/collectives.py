"""The script's own collectives: `torch.distributed` calls, passed to whoever listens (local, no communication).

`listen` wraps the collective functions of `torch.distributed` (and of `distributed_c10d`, through which torch's own
helpers call them) once per process, and passes each call the script makes to the listeners (and, to a listener
that asks for them, the calls FSDP2 and `replicate` make for the model: their all-gathers, reduce-scatters and
all-reduces, dozens a step, which the per-step digest compares but the beacon and the epoch-end timeline skip): the launcher's beacon
(where each rank is, for a hang or an abort) and the observed steps' per-step digest (compared across ranks at the
exchange). Calls from inside ddp_doctor, and calls nested in another collective (all_gather_object -> all_gather),
are not the script's and are not passed on. DDP's own gradient all-reduces run in C++ and never come through here.
With no listener, a wrapped call costs one list check.
"""

from __future__ import annotations

import functools
import os
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ddp_doctor.observation.hooks import ListenerList

__all__ = ["COLLECTIVES", "Call", "digest", "listen"]

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    # FSDP2's own all-gathers and reduce-scatters (torch 2.13 on; before, it called the two above), and the older
    # names torch's helpers may still call
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "_all_gather_base",
    "_reduce_scatter_base",
)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_DIRS = tuple(os.path.join(_PACKAGE, stage) + os.sep for stage in ("observation", "exchange"))
"""The doctor's own collectives (the exchange, the agreement to follow) are not the script's. Those of the fixes
(`sync_gradients`) are: the user calls them as part of the training step."""
_FSDP_DIR = os.path.join("torch", "distributed", "fsdp") + os.sep
"""FSDP2's (and `replicate`'s) own collectives are called from its modules here."""


@dataclass(frozen=True, slots=True)
class Call:
    """One collective the script entered."""

    op: str
    tensor: str | None
    """`dtype[shape]` of its first tensor (`float32[4]`), if any."""
    group_size: int | None
    reduce_op: str | None
    """The reduction (`SUM`, `MAX`, ...) when one was passed."""
    caller: FrameType
    first: torch.Tensor | None = None
    """The first tensor it was given (the one reduced in place, for an all_reduce)."""
    fsdp: bool = False
    """Issued by FSDP2 (or `replicate`) for the model, not by the script."""

    def describe(self) -> str:
        """`all_reduce(float32[1])`, `all_reduce(float32[1], MAX)`."""
        inner = ", ".join(x for x in (self.tensor, self.reduce_op) if x)
        return f"{self.op}({inner})" if inner else self.op

    def signature(self) -> str:
        """What must be equal on every rank of the group for the call to pair up: op, tensor and reduction."""
        return f"{self.describe()}/{self.group_size}"


Listener = tuple[Callable[[Call], None], Callable[[], None] | None, bool]
"""(on_enter, on_exit, whether it wants FSDP2's own calls too)."""
_listeners: ListenerList[Listener] = ListenerList()
_state = {"inside": False, "installed": False}


def digest(previous: int, call: Call) -> int:
    """A running 31-bit digest of a sequence of calls: equal on ranks that issued the same sequence."""
    return zlib.crc32(call.signature().encode(), previous) & 0x7FFFFFFF


def _describe(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], caller: FrameType, fsdp: bool) -> Call:
    values = (*args, *kwargs.values())
    tensor = next((a for a in values if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        lists = [a for a in values if isinstance(a, (list, tuple)) and a]
        tensor = next((x for lst in lists for x in lst if isinstance(x, torch.Tensor)), None)
    group = next((a for a in values if isinstance(a, dist.ProcessGroup)), None)
    op = (
        kwargs.get("op", next((a for a in args if isinstance(a, dist.ReduceOp.RedOpType)), None))
        if hasattr(dist.ReduceOp, "RedOpType")
        else kwargs.get("op")
    )
    # a ReduceOp object (NCCL's pre-multiplied sum, which FSDP2 uses) prints with its address: its type is equal
    # on every rank, the address is not
    reduction = None if op is None else str(op) if " at 0x" not in str(op) else type(op).__name__
    return Call(
        op=name,
        tensor=f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}" if tensor is not None else None,
        group_size=dist.get_world_size(group) if dist.is_initialized() else None,
        reduce_op=reduction.rsplit(".", 1)[-1] if reduction is not None else None,
        caller=caller,
        first=tensor,
        fsdp=fsdp,
    )


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if not _listeners or _state["inside"]:
            return original(*args, **kwargs)
        caller = sys._getframe(1)
        filename = caller.f_code.co_filename
        if filename.startswith(_OWN_DIRS):
            return original(*args, **kwargs)
        fsdp = _FSDP_DIR in filename
        listeners = [one for one in _listeners if one[2] or not fsdp]
        if not listeners:
            return original(*args, **kwargs)
        _state["inside"] = True
        try:
            call = _describe(name, args, kwargs, caller, fsdp)
            for on_enter, _, _ in listeners:
                on_enter(call)
            return original(*args, **kwargs)
        finally:
            _state["inside"] = False
            for _, on_exit, _ in listeners:
                if on_exit is not None:
                    on_exit()

    collective.__ddp_doctor_wrapped__ = original  # type: ignore[attr-defined]
    return collective


def _install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    c10d = dist.distributed_c10d
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapped = _wrap(name, original)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)


def listen(
    on_enter: Callable[[Call], None], on_exit: Callable[[], None] | None = None, *, fsdp: bool = False
) -> Callable[[], None]:
    """Pass each collective the script enters to `on_enter` (and its return to `on_exit`), and with `fsdp` those
    FSDP2 and `replicate` issue for the model too (`Call.fsdp`); returns the function that stops it. The first
    listener installs the wrappers, which stay (inert) for the life of the process."""
    _install()
    listener = (on_enter, on_exit, fsdp)
    return _listeners.add(listener)
