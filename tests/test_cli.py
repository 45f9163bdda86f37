from __future__ import annotations

import json
import subprocess
import sys

from ddp_doctor import CODES


def test_codes_command_lists_every_stable_code() -> None:
    out = subprocess.run([sys.executable, "-m", "ddp_doctor.cli", "codes", "--json"], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == CODES
