"""Run every benchmark under torchrun (2 ranks, gloo) and print a single table of median ratios."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

BENCHMARKS = {
    "observe_overhead": [
        "observed",
        "after_exit",
        "fsdp2 observed",
        "fsdp2 after_exit",
        "fsdp2 overhead vs ddp overhead",
    ],
    "guard_overhead": ["guard every=100", "guard every=10"],
    "sync_gradients": ["sync_gradients", "step with sync_gradients"],
    "refreeze_bytes": ["bytes after refreeze", "step after refreeze"],
    "fingerprint_cost": ["fingerprints_batched", "fingerprints (per tensor)", "fingerprints_batched per step"],
    "check_overhead": ["check, 8 steps", "check, 64 steps"],
    "sharded_overhead": ["fsdp2 overhead vs ddp overhead"],
    "collective_recording": ["collective recording"],
    "bench_cost": ["bench, 4 candidates x 3 rounds"],
}
"""Benchmark file (without .py) -> the keys of its JSON result to show. A result entry has `median_ratio` and
`iqr`, and may say what it is compared with (`vs`, default: plain DDP) and its `goal`."""


SELF_LAUNCHED = {"check_overhead", "bench_cost", "sharded_overhead"}
"""Benchmarks that start their own processes (they compare launchers) instead of running under torchrun."""


def run(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        script = str(Path(__file__).parent / f"{name}.py")
        launcher = (
            [] if name in SELF_LAUNCHED else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        )
        subprocess.run([sys.executable, *launcher, script, "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    only = sys.argv[1:]
    table = Table("benchmark", "variant", "median ratio", "IQR", "compared with", "goal", title="ddp-doctor benchmarks")
    for name, variants in BENCHMARKS.items():
        if only and name not in only:
            continue
        result = run(name)
        for v in variants:
            r = result[v]
            table.add_row(
                f"{name} ({result['param_tensors']} tensors)",
                v,
                f"{r['median_ratio']:.4f}x",
                f"{r['iqr'][0]:.4f}-{r['iqr'][1]:.4f}",
                r.get("vs", "plain DDP"),
                r.get("goal", ""),
            )
    # Not a terminal (CI logs, a file): wide enough that the rows do not wrap.
    Console(width=None if sys.stdout.isatty() else 150).print(table)


if __name__ == "__main__":
    main()
