"""Entry point of every rank under `ddp-doctor bench`: `python -m ddp_doctor.bench.start SCRIPT_ARGS...`.

The check's in-rank run (`launch/bootstrap.py`'s `run_rank`) with the bench's policy (`inrank.InRankBench`, built
from the `BenchPlan` the parent put in `plan.ENV_VAR`): after the check's observed steps the ranks go on with the
candidates' blocks in the same processes.
"""

from __future__ import annotations

from ddp_doctor.launch.config import RankConfig, die_with_parent

__all__ = ["WARM_IMPORTS", "main"]

WARM_IMPORTS = ("ddp_doctor.launch.session", "ddp_doctor.bench.inrank", "ddp_doctor.bench.plan")
"""What the warm launch's server imports before it forks a rank of this entry point (`launch/warm.py`)."""


def main() -> None:
    die_with_parent()
    from ddp_doctor.bench.inrank import InRankBench
    from ddp_doctor.bench.plan import BenchPlan
    from ddp_doctor.launch.bootstrap import run_rank

    plan = BenchPlan.from_env()
    run_rank(RankConfig.from_env(), lambda session: InRankBench(session, plan))


if __name__ == "__main__":
    main()
