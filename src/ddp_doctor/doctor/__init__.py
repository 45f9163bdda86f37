"""doctor: the in-process check. `observe()` and `Doctor` attach the observation to a DDP model, and `report()`
runs the pipeline (`pipeline.diagnose`): the exchange, the pure analysis, the `Report`.
"""

from __future__ import annotations

from ddp_doctor.doctor.doctor import Doctor, observe

__all__ = ["Doctor", "observe"]
