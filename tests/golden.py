"""Golden reports: `ddp-doctor check --json` on each bundled example, compared with a committed copy.

Only what varies from run to run is masked (the timings and the torchrun log's path); everything else, every
finding's text included, must be identical. The copies were made on one torch version and are compared whole only on
that version (another torch may word DDP's own errors differently). On any other torch, what does not depend on
the wording is still asserted (`invariants`: each finding's code, severity, parameters and ranks, the
recommendation's flags and frozen names, the run's shape), and then the test is skipped with the reason, so a
skipped golden comparison never hides a wrong diagnosis. To accept a deliberate change, run the check tests with
`DDP_DOCTOR_UPDATE_GOLDEN=1` and review the diff of `tests/golden/`.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"


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
    want, have = (json.dumps(d, indent=1, sort_keys=True).splitlines() for d in (expected, got))
    diff = "\n".join(difflib.unified_diff(want, have, "golden", "now", lineterm="", n=2))
    assert not diff, (
        f"the report of {name} changed; if that is intended, regenerate with DDP_DOCTOR_UPDATE_GOLDEN=1:\n{diff}"
    )
