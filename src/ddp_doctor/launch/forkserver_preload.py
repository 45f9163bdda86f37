"""Imported once, by the warm launch's forkserver (`warm.py`), before it forks any rank: nothing else imports it.

It ties the server's life to the launcher's (the kernel kills it when the launcher dies, and its ranks with it),
then imports torch, `torch.distributed` and what the entry module lists in `WARM_IMPORTS`. Importing is all it
does: no tensor is made, CUDA is never asked about, no thread pool of torch's starts. An import that fails here is
left for the rank to meet (and report) as it would in a fresh interpreter; multiprocessing's server must not die.
"""

from __future__ import annotations

import importlib
import os
import sys

from ddp_doctor.launch.config import die_with_parent
from ddp_doctor.launch.warm import PRELOAD_VAR

die_with_parent()


def _preload() -> None:
    names = ["torch", "torch.distributed"]
    entry = os.environ.get(PRELOAD_VAR)
    if entry:
        try:
            module = importlib.import_module(entry)
        except Exception:  # noqa: BLE001  (see the module docstring)
            module = None
        names += list(getattr(module, "WARM_IMPORTS", ()))
        # The rank runs the entry module as __main__ (runpy), which warns when it is imported already.
        sys.modules.pop(entry, None)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            continue


_preload()
