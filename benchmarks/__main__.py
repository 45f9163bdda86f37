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
    "observe_overhead": ["observed", "after_exit"],
}


def run(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(Path(__file__).parent / f"{name}.py"), "--json", str(out)], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    table = Table("benchmark", "variant", "median ratio vs plain DDP", "IQR", title="ddp-doctor benchmarks")
    for name, variants in BENCHMARKS.items():
        result = run(name)
        for v in variants:
            r = result[v]
            table.add_row(f"{name} ({result['param_tensors']} tensors)", v, f"{r['median_ratio']:.3f}x",
                          f"{r['iqr'][0]:.3f}-{r['iqr'][1]:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
