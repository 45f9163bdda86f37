"""Modules the script runs beside the DDP model: a distillation teacher, a frozen encoder, a target network.

DDP broadcasts rank 0's weights of the model it wraps, and nothing else: a module the script calls outside DDP's
forward holds whatever each rank built or loaded. When those differ across ranks (a per-rank seed before the
teacher is built, a checkpoint loaded on rank 0 only), each rank computes its loss from a different function and
nothing fails. A global forward hook (`observation/forward.py`) notes the outermost such call, of a module that
holds parameters or buffers and belongs to no DDP model; at each step the state scan (`observation/tree_scan.py`)
folds their fingerprints into the step's digest, which the ranks compare, and keeps one entry per module for the
analysis to name (`analyze/replica_state.py`).
"""

from __future__ import annotations

import itertools
import sys
import weakref
import zlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.compat import is_dtensor
from ddp_doctor.core.fingerprint import fingerprints_batched, readable
from ddp_doctor.core.frames import user_site, variable_names
from ddp_doctor.observation.target import WRAPPED

__all__ = ["BesideModules"]

MAX_MODULES = 8


class BesideModules:
    """The modules called outside DDP's forward, each noted at its first call.

    Args:
        tree: the ids of the DDP model's own modules (they are not beside it).
    """

    def __init__(self, tree: set[int]) -> None:
        self._tree = tree
        self._seen: set[int] = set()
        """Modules already looked at (noted or not): each costs one look."""
        self._noted: list[tuple[weakref.ref[nn.Module], str, str | None]] = []
        """(the module, its name, the script's line that called it)."""
        self._calls: list[int] = []
        """The modules whose forward is running, outermost first: only the outermost call is noted."""
        self.entries: list[dict[str, Any]] = []
        """At the last step, per module: `name` (the script's variable holding it, else its class), `site`,
        `tensors` and `numel` (its parameters and buffers), `fp` (their fingerprints summed)."""

    def enter(self, module: nn.Module) -> None:
        """A module's forward begins outside DDP's forward (the global pre-hook)."""
        if not self._calls and id(module) not in self._seen:
            self._seen.add(id(module))
            if len(self._noted) < MAX_MODULES and self._beside(module):
                names = variable_names([module], sys._getframe(1))
                name = names.get(id(module)) or type(module).__name__
                self._noted.append((weakref.ref(module), name, user_site()))
        self._calls.append(id(module))

    def exit(self, module: nn.Module) -> None:
        """That forward returned (or raised)."""
        if self._calls and self._calls[-1] == id(module):
            self._calls.pop()

    def _beside(self, module: nn.Module) -> bool:
        # Another DDP model (nobody observes it: DDP keeps its replicas equal itself) is not beside this one.
        if isinstance(module, DistributedDataParallel) or id(module) in self._tree:
            return False
        if not any(True for _ in _tensors(module)):
            return False
        return not any(module is ddp or module in ddp.module.modules() for ddp in list(WRAPPED))

    def scan(self, crc: int) -> int:
        """Fold the noted modules' parameters and buffers into the step's digest `crc` (the ranks compare it), and
        keep their entries."""
        entries = []
        for ref, name, site in self._noted:
            module = ref()
            if module is None:
                continue
            tensors = [t for _, t in _tensors(module) if readable(t)]
            if not tensors:
                continue
            fp = fingerprints_batched(tensors).sum(0).tolist()
            crc = zlib.crc32(f"beside {name}:{fp[0]!r},{fp[1]!r};".encode(), crc)
            numel = sum(t.numel() for t in tensors)
            entries.append({"name": name, "site": site, "tensors": len(tensors), "numel": numel, "fp": fp})
        self.entries = entries
        return crc


def _tensors(module: nn.Module) -> Any:
    """Its parameters and buffers, less DTensors (FSDP2's and tensor parallelism's shards differ across ranks by
    design)."""
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if t is not None and not is_dtensor(t):
            yield name, t
