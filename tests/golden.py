"""Golden reports: `ddp-doctor check --json` on each bundled example, compared with a committed copy.

Only what varies from run to run is masked (the timings and the torchrun log's path); everything else, every
finding's text included, must be identical. The copies were made on one torch version and are compared only on
that version (another torch may word DDP's own errors differently). To accept a deliberate change, run the check
tests with `DDP_DOCTOR_UPDATE_GOLDEN=1` and review the diff of `tests/golden/`.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parent / "golden"


def normalize(report: dict[str, Any]) -> dict[str, Any]:
    """The report with its run-to-run noise masked."""
    out = dict(report)
    out["timing"] = sorted(report.get("timing", {}))
    if "torchrun_log" in out:
        out["torchrun_log"] = "<path>"
    return out


def assert_matches_golden(name: str, report: dict[str, Any]) -> None:
    """`report` equals the golden copy `name` (when made on this torch version), or becomes it on update."""
    path = GOLDEN / f"{name}.json"
    got = normalize(report)
    if os.environ.get("DDP_DOCTOR_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        return
    expected = json.loads(path.read_text())
    if expected["torch_version"] != got["torch_version"]:
        return  # made on another torch: wording and numbers of DDP's own errors may differ
    want, have = (json.dumps(d, indent=1, sort_keys=True).splitlines() for d in (expected, got))
    diff = "\n".join(difflib.unified_diff(want, have, "golden", "now", lineterm="", n=2))
    assert not diff, (
        f"the report of {name} changed; if that is intended, regenerate with DDP_DOCTOR_UPDATE_GOLDEN=1:\n{diff}"
    )
