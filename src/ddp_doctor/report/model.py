"""The report users hold: `print(report)` draws it (`text.py`), `to_html()` makes its page (`html.py`). Its data,
its one constructor (`build`) and its JSON are `data.py`'s `ReportData`, which the renderers read, so the
renderers never need this module."""

from __future__ import annotations

from typing import Any

from ddp_doctor.report import html, text
from ddp_doctor.report.data import SCHEMA, ReportData, RunFacts

__all__ = ["SCHEMA", "Report", "RunFacts"]


class Report(ReportData):
    """The doctor's report, identical on every rank. `print(report)` renders it; `to_dict()` is the JSON schema;
    `Report.build(facts, diagnosis)` makes one."""

    def to_html(self) -> str:
        """The report as one self-contained HTML page: findings, both figures, the recommendation as code.

        Needs matplotlib (`pip install 'ddp-doctor[html]'`).

        Example:
            >>> Path("report.html").write_text(doctor.report().to_html())  # doctest: +SKIP
        """
        return html.to_html(self)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from text.render(self)

    def __str__(self) -> str:
        return text.to_text(self)
