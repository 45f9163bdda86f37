from __future__ import annotations

import json
import subprocess
import sys

from ddp_doctor import CODES

# The JSON contract (DESIGN 2.3), frozen here: a code may be added to this list, never renamed or removed.
STABLE_CODES = {
    "unused-parameters",
    "dynamic-graph",
    "rank-dependent-graph",
    "used-outside-forward",
    "find-unused-unneeded",
    "static-graph-unsafe",
    "reentrant-checkpoint",
    "wrapper-bypass",
    "grads-not-synced",
    "replica-divergence",
    "buffer-divergence",
    "frozen-after-wrap",
    "unfrozen-after-wrap",
    "identical-inputs-across-ranks",
    "reduction-error",
    "no-trainable-parameters",
    "rank-crashed",
    "rank-hung",
    "grad-blocked",
    "model-not-wrapped",
    "collective-mismatch",
    "uneven-inputs",
    "sampler-epoch-not-set",
    "rank-exited",
}


def test_codes_command_lists_every_stable_code() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "codes", "--json"], capture_output=True, text=True, check=True
    ).stdout
    listed = json.loads(out)
    assert listed == CODES
    assert STABLE_CODES <= set(listed), f"stable codes missing or renamed: {sorted(STABLE_CODES - set(listed))}"
    assert all(listed[c] for c in STABLE_CODES)  # each has its one-line explanation
