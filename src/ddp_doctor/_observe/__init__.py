"""observe: watch the first steps of a DDP model on this rank with local hooks, then diagnose them.

`doctor.py` is the public façade; `forward.py` and `backward.py` hold the hooks, `timeline.py` the step in
progress and its `Phase`, `steplog.py` the closed steps that become a `RankRecord`, `graph.py` the autograd walk,
and `crash.py` how an early end is recorded and DDP's own errors explained.
"""

from __future__ import annotations

from ddp_doctor._observe.doctor import Doctor, observe
from ddp_doctor._observe.phase import Phase

__all__ = ["Doctor", "Phase", "observe"]
