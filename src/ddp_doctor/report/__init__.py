"""report: the result objects and their renderers (text, HTML via `Report.to_html`, JSON via `Report.to_dict`)."""

from __future__ import annotations

from ddp_doctor.core.figures import Divergence, RankPattern, UsageMap, UsageRow
from ddp_doctor.core.findings import Crash, Diagnosis, Finding, ParamRef, Recommendation, Timing
from ddp_doctor.report.data import ReportData
from ddp_doctor.report.model import SCHEMA, Report, RunFacts

__all__ = [
    "SCHEMA",
    "Crash",
    "Diagnosis",
    "Divergence",
    "Finding",
    "ParamRef",
    "RankPattern",
    "Recommendation",
    "Report",
    "ReportData",
    "RunFacts",
    "Timing",
    "UsageMap",
    "UsageRow",
]
