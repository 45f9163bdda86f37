"""The house rule: packages by stage, in the order data flows, and no import from a lower stage up to a higher one,
and no import circles (ARCHITECTURE.md). Every `import` counts, also those inside functions: a late import hides a
dependency, it does not remove it. An import under `if TYPE_CHECKING:` never runs: it may not point upward either,
but it makes no circle (the report's model calls its renderers, which name the model's type only).

The checker is tested on a small package written to `tmp_path`, so it is known to fail when it should."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ddp_doctor

STAGES = [
    "core",
    "observation",
    "exchange",
    "analyze",
    "report",
    "doctor",
    "launch",
    "bench",
    "fixes",
    "integrations",
    "",
    "cli",
]
"""Bottom to top. "" is the package's own `__init__` (the public API); only the CLI sits above it."""


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module under `root` (the package's folder) by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes under `if TYPE_CHECKING:`."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports(name: str, path: Path, known: dict[str, Path], *, type_only: bool = True) -> set[str]:
    """The modules of the package that `name` imports (a `from a import b` of a submodule counts as `a.b`);
    without `type_only`, leaving out those under `if TYPE_CHECKING:`."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skip = set() if type_only else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = (
                ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else (node.module or "")
            )
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def stage_of(name: str, package: str, stages: list[str]) -> int:
    rest = name.split(".")[1:]
    first = rest[0] if rest else ""
    if first not in stages:
        raise AssertionError(f"{name} is in no stage: put it in one of {[s for s in stages if s]} (ARCHITECTURE.md)")
    return stages.index(first)


def violations(root: Path, package: str, stages: list[str]) -> list[str]:
    """Upward imports and import circles, in words."""
    known = modules(root, package)
    for name in known:
        stage_of(name, package, stages)
    every = {name: imports(name, path, known) for name, path in known.items()}
    graph = {name: imports(name, path, known, type_only=False) for name, path in known.items()}
    problems = []
    for name, targets in sorted(every.items()):
        for target in sorted(targets):
            low, high = stage_of(name, package, stages), stage_of(target, package, stages)
            if high > low:
                problems.append(
                    f"{name} (stage {stages[low] or 'api'}) imports {target} "
                    f"(stage {stages[high] or 'api'}), a higher stage"
                )
    # Circles: a depth-first search that reports each cycle once, by its smallest member.
    seen_cycles: set[tuple[str, ...]] = set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :]
                start = cycle.index(min(cycle))
                key = tuple(cycle[start:] + cycle[:start])
                if key not in seen_cycles:
                    seen_cycles.add(key)
                    problems.append("import circle: " + " -> ".join([*key, key[0]]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return problems


def test_no_upward_import_and_no_circle_in_ddp_doctor():
    root = Path(ddp_doctor.__file__).parent
    assert violations(root, "ddp_doctor", STAGES) == []


def test_every_stage_exists_and_no_two_modules_share_a_file_name():
    root = Path(ddp_doctor.__file__).parent
    for stage in filter(None, STAGES):
        assert (root / stage / "__init__.py").exists(), stage
    names: dict[str, list[str]] = {}
    for path in root.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(root)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


@pytest.mark.parametrize(
    "where, line",
    [
        ("low/a.py", "from pkg.high.b import x\n"),  # a plain upward import
        ("low/a.py", "def f():\n    from pkg.high import b\n"),  # hidden in a function
        ("low/a.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.high.b\n"),
        ("low/__init__.py", "from ..high.b import x\n"),  # relative
    ],
)
def test_the_checker_fails_on_an_upward_import(tmp_path, where, line):
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "X = 1\n",
        "high/__init__.py": "",
        "high/b.py": "from pkg.low.a import X\nx = X\n",
    }
    pkg = _write(tmp_path, files)
    assert violations(pkg, "pkg", ["low", "high", ""]) == []
    (pkg / where).write_text(line)
    found = violations(pkg, "pkg", ["low", "high", ""])
    assert any("a higher stage" in p and p.startswith("pkg.low") for p in found), found


def test_the_checker_fails_on_a_circle_within_a_stage(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "from pkg.low import b\n",
            "low/b.py": "def f():\n    from pkg.low.a import g\n",
        },
    )
    assert violations(pkg, "pkg", ["low", ""]) == ["import circle: pkg.low.a -> pkg.low.b -> pkg.low.a"]


def test_a_type_only_import_makes_no_circle_but_may_not_point_up(tmp_path):
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from pkg.low import b\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low.a import A\n",
    }
    pkg = _write(tmp_path, files)
    assert violations(pkg, "pkg", ["low", ""]) == []
    (pkg / "low/b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg\n")
    assert violations(pkg, "pkg", ["low", ""]) == ["pkg.low.b (stage low) imports pkg (stage api), a higher stage"]


def test_the_checker_names_a_module_outside_every_stage(tmp_path):
    pkg = _write(tmp_path, {"__init__.py": "", "low/__init__.py": "", "stray.py": "\n"})
    with pytest.raises(AssertionError, match="pkg.stray is in no stage"):
        violations(pkg, "pkg", ["low", ""])
