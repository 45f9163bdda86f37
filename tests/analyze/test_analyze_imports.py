"""The analysis reads typed data from core only: it imports nothing from the exchange or the observation (issue
#33), whatever the linear order of the stages in test_layers.py would allow. Imports inside functions and under
TYPE_CHECKING count too."""

from __future__ import annotations

import ast
from pathlib import Path

import ddp_doctor.analyze

BELOW = ("ddp_doctor.exchange", "ddp_doctor.observation")


def test_analyze_imports_nothing_from_the_exchange_or_the_observation() -> None:
    found = []
    for path in sorted(Path(ddp_doctor.analyze.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith(BELOW)]
    assert not found, found
