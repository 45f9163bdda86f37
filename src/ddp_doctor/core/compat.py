"""Everything that differs between the torch versions we support (2.4 to 2.16), in one place.

Each item names the versions it was checked on. Code elsewhere asks this module instead of probing torch with
`getattr` / `hasattr`, so the next torch release is one file to read. Versions run end to end are in the README's
compatibility table; "absent in 2.4.1" below means the core suite was run there (`make test-torch`).
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "DDP_ARGUMENTS",
    "FSDP2_MODULES",
    "HAS_FORWARD_SYNC_BUFFERS",
    "HAS_INIT_SYNC",
    "TORCH_VERSION",
    "ddp_broadcasts_buffers",
    "ddp_logging_data",
    "ddp_syncs_buffers",
    "default_store",
    "fsdp_module_type",
    "is_sharded",
    "is_dtensor",
    "parameters_to_ignore",
    "replicate_module_type",
]

logger = logging.getLogger(__name__)


def _version(text: str) -> tuple[int, int, int]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


TORCH_VERSION: tuple[int, int, int] = _version(torch.__version__)
"""(major, minor, patch) of the installed torch, local suffixes such as ``+cpu`` dropped."""

DDP_ARGUMENTS: frozenset[str] = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)
"""The keyword arguments the installed `DistributedDataParallel` accepts."""

HAS_INIT_SYNC: bool = "init_sync" in DDP_ARGUMENTS
"""`DDP(init_sync=False)` skips the initial broadcast of rank 0's state. Absent in 2.4.1, present in 2.13.0+."""

HAS_FORWARD_SYNC_BUFFERS: bool = "forward_sync_buffers" in DDP_ARGUMENTS
"""`forward_sync_buffers` replaces the deprecated `broadcast_buffers` (both accepted). Absent in 2.4.1, present in
2.13.0+; where it exists, `broadcast_buffers` is still accepted and maps onto it."""


def ddp_syncs_buffers(ddp: DistributedDataParallel) -> bool:
    """Whether DDP broadcasts rank 0's buffers at each forward (`forward_sync_buffers` / `broadcast_buffers`)."""
    if HAS_FORWARD_SYNC_BUFFERS and hasattr(ddp, "forward_sync_buffers"):
        return bool(ddp.forward_sync_buffers)
    return bool(getattr(ddp, "broadcast_buffers", True))


def ddp_broadcasts_buffers(ddp: DistributedDataParallel) -> bool:
    """Whether DDP broadcasts rank 0's buffers before its forwards at all: the flag, and buffers in the list DDP
    made at construction (`will_sync_module_buffers` reads it; DDP refreshes the list only while it is not empty, so
    a buffer registered after wrapping a model that had none is never broadcast)."""
    held = getattr(ddp, "modules_buffers", None)
    return ddp_syncs_buffers(ddp) and (held is None or len(held) > 0)


def ddp_logging_data(ddp: DistributedDataParallel) -> dict[str, Any] | None:
    """DDP's own construction record (`_get_ddp_logging_data`, private; present from 1.9 through 2.15.0).

    Returns None where it is missing or fails: nothing we diagnose depends on it, it only sharpens the wrap-time
    trainable count and the comm-hook name.
    """
    try:
        return dict(ddp._get_ddp_logging_data())
    except Exception:  # noqa: BLE001  (private API)
        logger.debug("DDP logging data unavailable on torch %s", torch.__version__)
        return None


def parameters_to_ignore(module: torch.nn.Module) -> frozenset[str]:
    """Names DDP never reduces (`_set_params_and_buffers_to_ignore_for_model`), stored on the DDP instance as
    `parameters_to_ignore` (2.4.1 through 2.15.0) or on the wrapped module as `_ddp_params_and_buffers_to_ignore`."""
    names = getattr(module, "parameters_to_ignore", None)
    if names is None:
        names = getattr(getattr(module, "module", module), "_ddp_params_and_buffers_to_ignore", ())
    return frozenset(names or ())


def default_store() -> dist.Store | None:
    """The default process group's key-value store (`distributed_c10d._get_default_store`, private; present from
    1.x through 2.15.0). None where it is missing: callers fall back to the process group's own timeout."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  (private API, or no default group)
        logger.debug("no default store on torch %s", torch.__version__)
        return None


def is_sharded(model: Any) -> bool:
    """Whether `model` is a module with FSDP2 modules in it (`fully_shard`'s, or the FSDP2-based `replicate`'s,
    which are `FSDPModule`s too)."""
    fsdp = fsdp_module_type()
    return fsdp is not None and isinstance(model, torch.nn.Module) and any(isinstance(m, fsdp) for m in model.modules())


FSDP2_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
"""Where `fully_shard` and `FSDPModule` live (2.6 on; 2.4 and 2.5)."""


def fsdp_module_type() -> type | None:
    """The class every module `fully_shard` (FSDP2) sharded becomes an instance of: `FSDPModule`, public in
    `torch.distributed.fsdp` from 2.6 (checked on 2.13.0 and 2.15.0), under `torch.distributed._composable.fsdp` in
    2.4 and 2.5. None where FSDP2 is missing (a torch built without distributed), or not imported in this process:
    no module can be an instance of it then, and its import costs about a second that a DDP job never pays."""
    if not any(name in sys.modules for name in FSDP2_MODULES):
        return None
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule

            return FSDPModule
        except ImportError:
            return None


def replicate_module_type() -> type | None:
    """The class every module the FSDP2-based `replicate` (`torch.distributed._composable.replicate_with_fsdp`, a
    subclass of `FSDPModule`) becomes an instance of: `ReplicateModule`, checked on 2.13.0 and 2.15.0. None where that
    `replicate` is missing (older releases have only the DDP-based one, which the DDP path already follows), or FSDP2
    was not imported in this process (it builds on FSDP2)."""
    if not any(name in sys.modules for name in FSDP2_MODULES):
        return None
    try:
        from torch.distributed._composable.replicate_with_fsdp import ReplicateModule

        return ReplicateModule
    except ImportError:
        return None


_IS_DTENSOR: dict[type, bool] = {}


def is_dtensor(t: object) -> bool:
    """A DTensor (FSDP2's sharded parameters and their gradients): `torch.distributed.tensor.DTensor` from 2.5,
    `torch.distributed._tensor.DTensor` in 2.4; by class name, so no import of either (one dict look-up per call:
    fingerprints ask it for every parameter of every step)."""
    cls = type(t)
    known = _IS_DTENSOR.get(cls)
    if known is None:
        known = _IS_DTENSOR[cls] = any(c.__name__ == "DTensor" for c in cls.__mro__)
    return known
