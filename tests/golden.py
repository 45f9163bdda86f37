"""Golden reports: `ddp-doctor check --json` on each bundled example, compared with a committed copy.

Only what varies from run to run is masked (the timings and the torchrun log's path); everything else, every
finding's text included, must be the same, with one allowance for the machine: float32 sums come out differently in
their 7th digit on CPUs of another vendor (0.3694651379723837 here, 0.3694651732005241 on an AMD EPYC), so measured
floats compare within a relative 1e-4 (`same`), and a decimal printed inside a text may differ by one unit in its
last printed digit (a rounding that fell the other way); integers and every other character must be identical. The copies were made on one torch version and are compared whole only on
that version (another torch may word DDP's own errors differently). On any other torch, what does not depend on
the wording is still asserted (`invariants`: each finding's code, severity, parameters and ranks, the
recommendation's flags and frozen names, the run's shape), and then the test is skipped with the reason, so a
skipped golden comparison never hides a wrong diagnosis. To accept a deliberate change, run the check tests with
`DDP_DOCTOR_UPDATE_GOLDEN=1` and review the diff of `tests/golden/`.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
REL_TOL = 1e-4
"""How far a measured float may move between machines (float32 sums differ in the 7th digit across CPU vendors)."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _close_decimals(a: str, b: str) -> bool:
    """Two numbers printed in a text: integers exactly, decimals within REL_TOL or one unit of the last digit."""
    if "." not in a + b:
        return a == b
    x, y = float(a), float(b)
    digits = min(len(s.split(".")[1].split("e")[0]) if "." in s else 0 for s in (a, b))
    return math.isclose(x, y, rel_tol=REL_TOL) or abs(x - y) <= 1.000001 * 10.0**-digits


def _same_text(a: str, b: str) -> bool:
    if a == b:
        return True
    if _NUMBER.split(a) != _NUMBER.split(b):
        return False
    return all(_close_decimals(x, y) for x, y in zip(_NUMBER.findall(a), _NUMBER.findall(b)))


def same(expected: Any, got: Any) -> bool:
    """`got` equals `expected` up to what differs between machines (see the module's docstring)."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return expected is got
    if isinstance(expected, float) or isinstance(got, float):
        if not isinstance(expected, int | float) or not isinstance(got, int | float):
            return False
        return math.isclose(expected, got, rel_tol=REL_TOL, abs_tol=1e-12)
    if isinstance(expected, str) and isinstance(got, str):
        return _same_text(expected, got)
    if isinstance(expected, dict) and isinstance(got, dict):
        return expected.keys() == got.keys() and all(same(expected[k], got[k]) for k in expected)
    if isinstance(expected, list) and isinstance(got, list):
        return len(expected) == len(got) and all(same(x, y) for x, y in zip(expected, got))
    return type(expected) is type(got) and expected == got


def normalize(report: dict[str, Any]) -> dict[str, Any]:
    """The report with its run-to-run noise masked."""
    out = dict(report)
    out["timing"] = sorted(report.get("timing", {}))
    if "torchrun_log" in out:
        out["torchrun_log"] = "<path>"
    if "following" in out:
        out["following"] = {**out["following"], "seconds": "<seconds>"}
    return out


def invariants(report: dict[str, Any]) -> dict[str, Any]:
    """What the diagnosis is, whatever the torch version: no text, no numbers measured in the run."""
    rec = report["recommendation"]
    return {
        "schema": report["schema"],
        "world_size": report["world_size"],
        "steps_observed": report["steps_observed"],
        "framework": report.get("framework"),
        "findings": [
            (f["code"], f["severity"], sorted(p["name"] for p in f["params"]), f["ranks"]) for f in report["findings"]
        ],
        "recommendation": {
            k: rec[k]
            for k in (
                "find_unused_parameters",
                "static_graph",
                "gradient_as_bucket_view",
                "freeze_before_wrap",
                "verified",
            )
        },
    }


def assert_matches_golden(name: str, report: dict[str, Any]) -> None:
    """`report` equals the golden copy `name` (when made on this torch version), or becomes it on update."""
    path = GOLDEN / f"{name}.json"
    got = normalize(report)
    if os.environ.get("DDP_DOCTOR_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        return
    expected = json.loads(path.read_text())
    if expected["torch_version"] != got["torch_version"]:
        assert invariants(got) == invariants(expected), f"the diagnosis of {name} differs from its golden copy"
        pytest.skip(
            f"golden text of {name} was made on torch {expected['torch_version']}, this is {got['torch_version']}: "
            "only the diagnosis (codes, severities, parameters, ranks, recommendation) was compared"
        )
    if same(expected, got):
        return
    want, have = (json.dumps(d, indent=1, sort_keys=True).splitlines() for d in (expected, got))
    diff = "\n".join(difflib.unified_diff(want, have, "golden", "now", lineterm="", n=2))
    pytest.fail(
        f"the report of {name} changed; if that is intended, regenerate with DDP_DOCTOR_UPDATE_GOLDEN=1:\n{diff}"
    )
