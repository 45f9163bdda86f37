"""`ddp-doctor bench`: time the candidate DDP configurations on the user's own script, keep the correct ones."""

from __future__ import annotations

from ddp_doctor.bench.candidates import Config, candidates
from ddp_doctor.bench.run import NOISE_FLOOR, BenchResult, Candidate, run_bench

__all__ = ["NOISE_FLOOR", "BenchResult", "Candidate", "Config", "candidates", "run_bench"]
