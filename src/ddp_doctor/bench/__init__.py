"""`ddp-doctor bench`: time the candidate DDP configurations on the user's own script, keep the correct ones."""

from __future__ import annotations

from ddp_doctor.bench.candidates import Config, candidates
from ddp_doctor.bench.result import BenchResult, Candidate, Launch
from ddp_doctor.bench.run import run_bench
from ddp_doctor.bench.stats import Verdict, decide

__all__ = ["BenchResult", "Candidate", "Config", "Launch", "Verdict", "candidates", "decide", "run_bench"]
