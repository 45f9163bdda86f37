"""Every number a finding's title or detail states is in its typed evidence (JSON `params`, `ranks`, `steps`,
`more_ranks`, `sites`, `measured`), so that a reader of the JSON gets it as a fact, not only inside a sentence. Checked on the
golden reports of the bundled examples (tests/golden/, real `check` runs); the checker is tested on hand-built
findings."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
_NUMBER = re.compile(r"(?<![\w.:/-])(\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?)(?![\w/]|\.\d)")
"""A number in running text (not a part of a name, a path, a `file:line` or a version)."""


def evidence(f: dict[str, Any]) -> set[float]:
    """The numbers a finding's JSON carries as evidence, counts of its lists included."""
    found: set[float] = {len(f["params"]), len(f["ranks"]), len(f["steps"]), f.get("more_ranks", 0)}
    for p in f["params"]:
        found |= {p["numel"], *p["shape"]}
    found |= {*f["ranks"], *f["steps"], *(int(s.rsplit(":", 1)[1]) for s in f.get("sites", []))}
    found |= {m["value"] for m in f.get("measured", []) if m["value"] is not None}
    return {float(x) for x in found}


def unbacked(f: dict[str, Any]) -> list[str]:
    """The numbers of `f`'s title and detail that its evidence does not hold (a printed float within 0.6%)."""
    held = evidence(f)
    said = _NUMBER.findall(f"{f['title']} {f['detail']}")
    return [t for t in said if not any(abs(float(t.replace(",", "")) - x) <= 1e-9 + 0.006 * abs(x) for x in held)]


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.stem)
def test_every_number_a_finding_states_is_in_its_evidence(path: Path) -> None:
    report = json.loads(path.read_text())
    missing = {f["code"]: unbacked(f) for f in report["findings"] if unbacked(f)}
    assert missing == {}, missing


def test_the_checker_finds_a_number_said_only_in_words() -> None:
    base = {"params": [], "ranks": [0, 1], "steps": [3], "sites": ["train.py:40"], "measured": []}
    ok = {**base, "title": "2 ranks differ at step 3", "detail": "at train.py:40, 1.5 apart"}
    ok["measured"] = [{"name": "gap", "value": 1.4999, "unit": "abs"}]
    assert unbacked(ok) == []
    assert unbacked({**ok, "detail": "rank 0: 13 batches, torch 2.13.0, layers.12.weight"}) == ["13"]
