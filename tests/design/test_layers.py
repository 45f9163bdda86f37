"""The house rules a newcomer can read (docs/architecture.md), each checked here:

- each package of `ddp_doctor` imports only the packages `ALLOWED` names for it. Every `import` counts: those inside
  functions (a late import hides a dependency, it does not remove it) and those under `if TYPE_CHECKING:`;
- no import circles, `TYPE_CHECKING` ones included (a type a lower module needs is a `Protocol` it states itself);
- every module sits in a package of the table, and no two modules share a file name;
- no source file over `MAX_LINES` lines, no class over `MAX_METHODS` methods (one concept per file, STYLE.md);
- (in tests/design/test_doc_names.py) every module, file, finding code, class or function of ours named in backquotes in
  docs/architecture.md, ARCHITECTURE.md and the module docstrings exists.

Each checker is tested on a small package written to `tmp_path`, so it is known to fail when it should."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ddp_doctor

ROOT = Path(ddp_doctor.__file__).parent
REPO = ROOT.parent.parent

ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "observation": {"core"},
    "exchange": {"core"},
    "analyze": {"core"},
    "report": {"core"},
    "doctor": {"core", "observation", "exchange", "analyze", "report"},
    "launch": {"core", "observation", "exchange", "analyze", "report", "doctor"},
    "bench": {"core", "observation", "exchange", "analyze", "report", "doctor", "launch"},
    "fixes": {"core", "observation", "exchange", "analyze"},
    "integrations": {"core", "observation", "report", "doctor"},
    "": {"core", "report", "doctor", "fixes"},
    "cli": {"", "core", "report", "launch", "bench"},
}
"""Which packages each package of `ddp_doctor` may import ("" is the package's own `__init__`, the public API).

The data every stage shares is typed once in `core` (records, the exchange's `Summary`, findings, rank files), so
`observation` (what one rank sees), `exchange` (what the ranks tell each other) and `analyze` (pure: typed inputs
in, a `Diagnosis` out) need nothing but `core`, and neither does `report` (it draws). `doctor` strings them
together in one process; `launch` runs the check in every rank and reads the ranks' files; `bench` runs on top of a
launch; the fixes (`guard`, `refreeze`, `sync_gradients`) share the exchange's primitives and the analysis' finding
builders, never the check's run; the integrations start a doctor in a framework's callbacks."""

MAX_LINES = 400
MAX_METHODS = 20


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module under `root` (the package's folder) by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that `name` imports, anywhere in it (a `from a import b` of a submodule counts
    as `a.b`)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def package_of(name: str, allowed: dict[str, set[str]]) -> str:
    rest = name.split(".")[1:]
    first = rest[0] if rest else ""
    if first not in allowed:
        raise AssertionError(f"{name} is in no package of the table: put it in one of {sorted(filter(None, allowed))}")
    return first


def violations(root: Path, package: str, allowed: dict[str, set[str]]) -> list[str]:
    """Imports the table does not allow, and import circles, in words."""
    known = modules(root, package)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    problems = []
    for name, targets in sorted(graph.items()):
        mine = package_of(name, allowed)
        for target in sorted(targets):
            theirs = package_of(target, allowed)
            if theirs != mine and theirs not in allowed[mine]:
                problems.append(
                    f"{name} imports {target}, but {mine or 'api'} may import only "
                    f"{', '.join(sorted(p or 'api' for p in allowed[mine])) or 'nothing of the package'}"
                )
    return problems + circles(graph)


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle of `graph` once, in words, starting from its smallest member (a depth-first search)."""
    seen: set[tuple[str, ...]] = set()
    state: dict[str, int] = {}
    stack: list[str] = []
    problems = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :]
                start = cycle.index(min(cycle))
                key = tuple(cycle[start:] + cycle[:start])
                if key not in seen:
                    seen.add(key)
                    problems.append("import circle: " + " -> ".join([*key, key[0]]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return problems


def oversized(root: Path, *, max_lines: int = MAX_LINES, max_methods: int = MAX_METHODS) -> list[str]:
    """Files over `max_lines` lines and classes over `max_methods` methods, in words."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(root)
        if (n := len(text.splitlines())) > max_lines:
            problems.append(f"{rel} has {n} lines (at most {max_lines}: split it by concept)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef)]
                if len(methods) > max_methods:
                    problems.append(f"{rel}: class {node.name} has {len(methods)} methods (at most {max_methods})")
    return problems


# ------------------------------------------------------------------------------------------------ ddp_doctor


def test_each_package_imports_only_what_the_table_allows_and_no_circle():
    assert violations(ROOT, "ddp_doctor", ALLOWED) == []


def test_the_table_itself_has_no_circle():
    graph = {p: set(ALLOWED[p]) for p in ALLOWED}
    assert circles(graph) == []


def test_every_package_exists_and_no_two_modules_share_a_file_name():
    for package in filter(None, ALLOWED):
        assert (ROOT / package / "__init__.py").exists(), package
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} == set(filter(None, ALLOWED))
    names: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def test_no_file_over_400_lines_and_no_class_over_20_methods():
    assert oversized(ROOT) == []


# ------------------------------------------------------------------------------------------------ the checkers

TABLE = {"low": set(), "high": {"low"}, "": {"low", "high"}}


def write_package(root: Path, files: dict[str, str]) -> Path:
    """A package `pkg` of `files` (relative path -> text) under `root`, for a checker to read."""
    pkg = root / "pkg"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


@pytest.mark.parametrize(
    "where, line",
    [
        ("low/a.py", "from pkg.high.b import x\n"),  # a plain import the table does not allow
        ("low/a.py", "def f():\n    from pkg.high import b\n"),  # hidden in a function
        ("low/a.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.high.b\n"),
        ("low/__init__.py", "from ..high.b import x\n"),  # relative
    ],
)
def test_the_checker_fails_on_an_import_the_table_does_not_allow(tmp_path, where, line):
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "X = 1\n",
        "high/__init__.py": "",
        "high/b.py": "from pkg.low.a import X\nx = X\n",
    }
    pkg = write_package(tmp_path, files)
    assert violations(pkg, "pkg", TABLE) == []
    (pkg / where).write_text(line)
    found = violations(pkg, "pkg", TABLE)
    assert any("but low may import only nothing of the package" in p and p.startswith("pkg.low") for p in found), found


def test_the_checker_fails_on_a_sibling_the_table_leaves_out(tmp_path):
    files = {"__init__.py": "", "a/__init__.py": "", "a/x.py": "from pkg.b import y\n", "b/__init__.py": ""}
    pkg = write_package(tmp_path, files)
    assert violations(pkg, "pkg", {"a": set(), "b": set(), "": {"a", "b"}}) == [
        "pkg.a.x imports pkg.b, but a may import only nothing of the package"
    ]
    assert violations(pkg, "pkg", {"a": {"b"}, "b": set(), "": {"a", "b"}}) == []


def test_the_checker_fails_on_a_circle_within_a_package(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "from pkg.low import b\n",
            "low/b.py": "def f():\n    from pkg.low.a import g\n",
        },
    )
    assert violations(pkg, "pkg", TABLE) == ["import circle: pkg.low.a -> pkg.low.b -> pkg.low.a"]


def test_a_type_only_import_makes_a_circle_too(tmp_path):
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from pkg.low import b\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low.a import A\n",
    }
    pkg = write_package(tmp_path, files)
    assert violations(pkg, "pkg", TABLE) == ["import circle: pkg.low.a -> pkg.low.b -> pkg.low.a"]


def test_the_checker_names_a_module_outside_every_package(tmp_path):
    pkg = write_package(tmp_path, {"__init__.py": "", "low/__init__.py": "", "stray.py": "\n"})
    with pytest.raises(AssertionError, match="pkg.stray is in no package of the table"):
        violations(pkg, "pkg", TABLE)


def test_the_size_checker_fails_on_a_long_file_and_a_big_class(tmp_path):
    pkg = write_package(tmp_path, {"__init__.py": "", "a.py": "x = 1\n" * 5})
    assert oversized(pkg, max_lines=5, max_methods=2) == []
    (pkg / "a.py").write_text("x = 1\n" * 6)
    (pkg / "b.py").write_text("class Big:\n" + "".join(f"    def m{i}(self): ...\n" for i in range(3)))
    assert oversized(pkg, max_lines=5, max_methods=2) == [
        "a.py has 6 lines (at most 5: split it by concept)",
        "b.py: class Big has 3 methods (at most 2)",
    ]


def test_the_modules_a_report_is_read_and_drawn_with_import_no_torch() -> None:
    """The `ddp-doctor` process reads the ranks' joint report and draws it without torch (torch's import costs
    seconds, and a C++ log level is set only where this process imports torch itself: launch/watch_nodes.py)."""
    import subprocess
    import sys

    modules = ["ddp_doctor.core.agreed", "ddp_doctor.core.findings", "ddp_doctor.core.sharded_run"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False", done.stdout
