"""The sentences of the findings whose detectors leave them to the report: each code's title and detail, written
from the finding's typed evidence alone (its parameters, ranks, steps, `labels`, `measured`, `sites`), the way
rich's `Table.add_row` takes the data and `__rich_console__` writes it out. `ReportData.build` words every finding
it is given; a finding that already carries its text (a code not moved here yet) is left as it is.

A code is moved here by giving it a function registered with `wording.words` in its family's module
(`graph_words.py`, `sync_words.py`, `failure_words.py`, `checkpoint_words.py`) and removing `title=` and `detail=` from its builders, which
then put whatever the words need into the evidence (`tests/design/test_one_road.py` holds every builder of a code
registered here to that). The labels each code's words read are in docs/json-schema.md's table.
"""

from __future__ import annotations

import dataclasses

from ddp_doctor.core.findings import Finding
from ddp_doctor.report import checkpoint_words, failure_words, graph_words, sync_words  # noqa: F401  (each registers its codes' words)
from ddp_doctor.report.wording import WORDS

__all__ = ["WORDS", "worded"]


def worded(f: Finding) -> Finding:
    """`f` with its title and detail written from its evidence where its code's words are here and it has none."""
    fn = WORDS.get(f.code)
    if f.title:
        return f
    assert fn is not None, f"{f.code} was built without words, and the report has none for it"
    title, detail = fn(f)
    return dataclasses.replace(f, title=title, detail=detail)
