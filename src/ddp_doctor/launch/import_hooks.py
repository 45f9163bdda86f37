"""Run a patch when a module is imported, not before: the check's FSDP2 patches wait for the script (or its
framework) to import `torch.distributed.fsdp`, whose import costs about a second (sympy) that a DDP job never pays.

`when_imported(name, patch)` calls `patch()` at once when `name` is already imported; otherwise right after the
module's own code has run, inside the import, so `from name import x` in the script already reads what the patch
put there. One finder on `sys.meta_path` holds the waiting patches; it only looks up the module the other finders
find, and leaves every other import alone.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["when_imported"]


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.waiting: dict[str, list[Callable[[], None]]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.waiting:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        patches = self.waiting.pop(fullname)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            for patch in patches:
                patch()

        spec.loader.exec_module = exec_then_patch  # this spec's own loader: one per module file
        return spec


_FINDER = _AfterImport()


def when_imported(name: str, patch: Callable[[], None]) -> None:
    """Call `patch()` once `name` is imported (at once if it already is)."""
    if name in sys.modules:
        patch()
        return
    _FINDER.waiting.setdefault(name, []).append(patch)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
