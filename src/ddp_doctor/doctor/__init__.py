"""doctor: the in-process check. `observe()` and `Doctor` attach the observation to a DDP model, and `report()`
runs the pipeline (`pipeline.diagnose`): the exchange, the pure analysis, the `Report`. For a model sharded with
FSDP2, `observe()` returns a `ShardedDoctor`, which follows the optimizer's steps with `PlainOptimizerWatch` (the
check's watch in a script without DDP) and reports through `sharded_report`.
"""

from __future__ import annotations

from ddp_doctor.doctor.doctor import Doctor, observe
from ddp_doctor.doctor.sharded_doctor import ShardedDoctor

__all__ = ["Doctor", "ShardedDoctor", "observe"]
