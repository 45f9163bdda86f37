"""report: the result objects and their renderers (text here; JSON via `Report.to_dict`)."""

from __future__ import annotations

from ddp_doctor.report.model import (
    SCHEMA,
    Crash,
    Diagnosis,
    Finding,
    ParamRef,
    Recommendation,
    Report,
    Timing,
)

__all__ = ["SCHEMA", "Crash", "Diagnosis", "Finding", "ParamRef", "Recommendation", "Report", "Timing"]
