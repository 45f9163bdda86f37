"""The implementation of `ddp_doctor.guard` and `ddp_doctor.Guard` (private: import those names from `ddp_doctor`).

- `facade`: `guard()` and `Guard`, the public API, and the replica check it schedules.
- `hooks`: the hooks on DDP, the module and the optimizer, and what each event triggers.
- `bypass`: calls that bypass the DDP wrapper.
- `flips`: `requires_grad` changed after DDP was built.
- `compare`: the cross-rank replica comparison and its findings.
- `problems`: recording, logging once, or raising.
"""

from __future__ import annotations

from ddp_doctor.fixes.guard.facade import GUARD_ATTR, Guard, guard

__all__ = ["GUARD_ATTR", "Guard", "guard"]
