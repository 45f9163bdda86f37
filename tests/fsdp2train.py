"""`ddp-doctor check` on tests/scripts/fsdp2_train.py, shared by the FSDP2 check tests (its ground truth is in
tests/fsdp2/test_check_fsdp2.py and test_check_fsdp2_some_ranks.py)."""

from __future__ import annotations

from pathlib import Path

from checkrun import SCRIPTS, Run, check

SCRIPT = str(SCRIPTS / "fsdp2_train.py")


def line_of(text: str, nth: int = 0) -> str:
    """`fsdp2_train.py:N` of the `nth` line of the script holding `text`."""
    lines = [i for i, line in enumerate(Path(SCRIPT).read_text().splitlines(), 1) if text in line]
    return f"fsdp2_train.py:{lines[nth]}"


def check_mistake(tmp_path: Path, mistake: str, ranks: int = 2) -> Run:
    """The check of the script with `--mistake MISTAKE` on `ranks` ranks. --no-verify: a clean or warning-only run's
    reshard_after_forward advice would be verified in a second run of the script, which the transformer test
    covers."""
    args = ["--nproc-per-node", str(ranks), "--no-verify", SCRIPT, "--mistake", mistake]
    return check(args, tmp_path, timeout=180)
