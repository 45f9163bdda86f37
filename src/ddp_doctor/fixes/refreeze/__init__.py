"""The implementation of `ddp_doctor.refreeze`, `ddp_doctor.progressive_freeze` and `ddp_doctor.ProgressiveFreeze`
(private: import those names from `ddp_doctor`).

- `rebuild`: `refreeze()` itself, `constructor_kwargs`, and retiring the replaced DDP.
- `preflight`: what is proven across ranks before anything changes (the same valid plan, identical replicas).
- `select`: `freeze=` / `unfreeze=` resolved to parameter names.
- `progressive`: `progressive_freeze()`, a schedule of `refreeze` calls.
"""

from __future__ import annotations

from ddp_doctor.fixes.refreeze.progressive import ProgressiveFreeze, Schedule, progressive_freeze
from ddp_doctor.fixes.refreeze.rebuild import refreeze
from ddp_doctor.fixes.refreeze.select import ParamSpec, resolve
from ddp_doctor.observation.wrapstate import constructor_kwargs

__all__ = [
    "ParamSpec",
    "ProgressiveFreeze",
    "Schedule",
    "constructor_kwargs",
    "progressive_freeze",
    "refreeze",
    "resolve",
]
