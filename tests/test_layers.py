"""The house rules a newcomer can read (docs/architecture.md), each checked here:

- each package of `ddp_doctor` imports only the packages `ALLOWED` names for it. Every `import` counts: those inside
  functions (a late import hides a dependency, it does not remove it) and those under `if TYPE_CHECKING:`;
- no import circles, `TYPE_CHECKING` ones included (a type a lower module needs is a `Protocol` it states itself);
- every module sits in a package of the table, and no two modules share a file name;
- no source file over `MAX_LINES` lines, no class over `MAX_METHODS` methods (one concept per file, STYLE.md);
- every module, file, finding code, class or function of ours named in backquotes in docs/architecture.md,
  ARCHITECTURE.md and the module docstrings exists (`stale_names`).

Each checker is tested on a small package written to `tmp_path`, so it is known to fail when it should."""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

import ddp_doctor
from ddp_doctor.core.codes import CODES

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


# ------------------------------------------------------------------------------------------------ names in docs

FOREIGN = {
    # torch's, the frameworks' and a user script's names the docs quote (ours are checked, these are not)
    "Accelerator", "DDPStrategy", "GradScaler", "PreTrainedModel", "SequentialLR", "Trainer", "TrainingArguments",
    "accelerator", "clip_grad_norm_", "clip_grad_value_", "compute_loss", "d_loss", "ddp_broadcast_buffers",
    "ddp_bucket_cap_mb", "ddp_find_unused_parameters", "ddp_static_graph", "fully_shard", "g_loss", "lightning",
    "loss_fn", "manual_backward", "max_batches", "mul_", "no_sync", "on_epoch_end", "pytorch", "pytorch_lightning",
    "reshard_after_forward",
    "train", "training_step", "W",
}  # fmt: skip
_CHAIN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_PATH = re.compile(r"^[\w./-]*\w(\.py|/)$")
_CODE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)+$")
_OUTPUT = re.compile(r"^[\w.{}]+\.(json|log|html|txt|svg|beacon|fault)$")  # files a run writes


class Index:
    """What a package defines, read from its source: modules, each module's top-level names, each class's
    attributes (its body, `self.x = ...` in its methods, and its bases'), and every identifier its code uses (and
    the code under `also`: the tests, which the docs name too)."""

    def __init__(self, root: Path, package: str, also: Iterable[Path] = ()) -> None:
        self.root, self.package = root, package
        self.modules = modules(root, package)
        self.top: dict[str, set[str]] = {}
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}
        self.used: set[str] = set(dir(builtins))
        for name, path in self.modules.items():
            tree = ast.parse(path.read_text())
            self.top[name] = set()
            for node in tree.body:
                self.top[name].update(_bound(node))
                if isinstance(node, ast.ClassDef):
                    attrs = {n for stmt in node.body for n in _bound(stmt)}
                    attrs |= {
                        t.attr
                        for n in ast.walk(node)
                        for t in (n.targets if isinstance(n, ast.Assign) else [getattr(n, "target", None)])
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                    }
                    self.classes.setdefault(node.name, []).append((attrs, [ast.unparse(b) for b in node.bases]))
            self.used.update(_identifiers(tree))
        for path in also:
            self.used.update(_identifiers(ast.parse(path.read_text())))
        self.stems = {part for name in self.modules for part in name.split(".")}

    def _class_has(self, cls: str, attr: str, depth: int = 0) -> bool:
        for attrs, bases in self.classes.get(cls, []):
            if attr in attrs or (depth < 5 and any(self._class_has(b.split(".")[-1], attr, depth + 1) for b in bases)):
                return True
        return False

    def resolves(self, parts: list[str]) -> bool:
        """`a.b.c` names something of ours: a module (by its full dotted name or its last name), then a top-level
        name in it, then an attribute of a class; or a class, then its attribute. What a top-level name that is no
        class holds is not followed."""
        first, rest = parts[0], parts[1:]
        if first in self.classes and (not rest or self._class_has(first, rest[0])):
            return True
        if first == self.package:
            return self._walk(first, rest)
        return any(self._walk(name, rest) for name in self.modules if name.split(".")[-1] == first)

    def _walk(self, name: str, rest: list[str]) -> bool:
        i = 0
        while i < len(rest) and ".".join([name, *rest[: i + 1]]) in self.modules:
            i += 1
        mod, tail = ".".join([name, *rest[:i]]), rest[i:]
        if not tail:
            return True
        if tail[0] not in self.top[mod]:
            return False
        return len(tail) == 1 or tail[0] not in self.classes or self._class_has(tail[0], tail[1])

    def problem(self, token: str, where: Path) -> str | None:
        """Why `token` (backquoted in `where`) names nothing, or None."""
        t = token.strip()
        if _PATH.match(t):
            here = where.parent
            bare = "/" not in t.rstrip("/")
            places = [REPO / t, self.root / t, self.root.parent / t, here / t]
            if any(p.exists() for p in places) or (bare and any(self.root.rglob(t.rstrip("/")))):
                return None
            return f"no file or folder {t}"
        if _CODE.match(t):
            return None if t in CODES or t == "ddp-doctor" else f"no finding code {t}"
        head = re.sub(r"\(.*\)$", "", t)
        if not _CHAIN.match(head) or _OUTPUT.match(t):
            return None  # prose, a command line, a snippet of code
        parts = head.split(".")
        ours = parts[0] not in FOREIGN and (
            parts[0] in (self.package, *self.stems, *self.classes)
            or (parts[0].startswith("_") and not parts[0].startswith("__"))
        )
        if ours:
            return None if self.resolves(parts) else f"{head} is no module, class, function or attribute of ours"
        if parts[0] in self.used or parts[0] in FOREIGN:
            return None
        return f"{parts[0]} is named nowhere in the code (a foreign name goes in FOREIGN)"


def _identifiers(tree: ast.Module) -> Iterator[str]:
    """Every identifier the code of `tree` binds or uses."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield n.name
        elif isinstance(n, ast.arg):
            yield n.arg
        elif isinstance(n, ast.keyword) and n.arg:
            yield n.arg
        elif isinstance(n, ast.alias):
            yield from n.name.split(".")
        elif isinstance(n, ast.ImportFrom) and n.module:
            yield from n.module.split(".")


def _bound(node: ast.stmt) -> Iterator[str]:
    """The names a top-level or class-body statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield node.name
    elif isinstance(node, ast.Assign):
        for t in node.targets:
            yield from (n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
        yield node.target.id
    elif isinstance(node, ast.Import | ast.ImportFrom):
        yield from ((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, ast.If | ast.Try):
        for stmt in [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]:
            yield from _bound(stmt)


def stale_names(index: Index, texts: Iterable[tuple[Path, str]]) -> list[str]:
    """Every backquoted name in `texts` that names nothing, in words."""
    out = []
    for where, text in texts:
        for token in re.findall(r"`([^`\n]+)`", text):
            if (why := index.problem(token, where)) is not None:
                shown = where.relative_to(REPO) if where.is_relative_to(REPO) else where.name
                out.append(f"{shown}: `{token}`: {why}")
    return out


def docs_and_docstrings(root: Path, extra: Iterable[Path] = ()) -> Iterator[tuple[Path, str]]:
    for path in sorted(root.rglob("*.py")):
        yield path, ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    for path in extra:
        yield path, path.read_text()


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


def test_every_name_in_backquotes_in_the_docs_and_docstrings_exists():
    docs = [REPO / "docs" / "architecture.md", REPO / "ARCHITECTURE.md"]
    index = Index(ROOT, "ddp_doctor", also=sorted((REPO / "tests").rglob("*.py")))
    assert stale_names(index, docs_and_docstrings(ROOT, docs)) == []


# ------------------------------------------------------------------------------------------------ the checkers

TABLE = {"low": set(), "high": {"low"}, "": {"low", "high"}}


def _write(root: Path, files: dict[str, str]) -> Path:
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
    pkg = _write(tmp_path, files)
    assert violations(pkg, "pkg", TABLE) == []
    (pkg / where).write_text(line)
    found = violations(pkg, "pkg", TABLE)
    assert any("but low may import only nothing of the package" in p and p.startswith("pkg.low") for p in found), found


def test_the_checker_fails_on_a_sibling_the_table_leaves_out(tmp_path):
    files = {"__init__.py": "", "a/__init__.py": "", "a/x.py": "from pkg.b import y\n", "b/__init__.py": ""}
    pkg = _write(tmp_path, files)
    assert violations(pkg, "pkg", {"a": set(), "b": set(), "": {"a", "b"}}) == [
        "pkg.a.x imports pkg.b, but a may import only nothing of the package"
    ]
    assert violations(pkg, "pkg", {"a": {"b"}, "b": set(), "": {"a", "b"}}) == []


def test_the_checker_fails_on_a_circle_within_a_package(tmp_path):
    pkg = _write(
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
    pkg = _write(tmp_path, files)
    assert violations(pkg, "pkg", TABLE) == ["import circle: pkg.low.a -> pkg.low.b -> pkg.low.a"]


def test_the_checker_names_a_module_outside_every_package(tmp_path):
    pkg = _write(tmp_path, {"__init__.py": "", "low/__init__.py": "", "stray.py": "\n"})
    with pytest.raises(AssertionError, match="pkg.stray is in no package of the table"):
        violations(pkg, "pkg", TABLE)


def test_the_size_checker_fails_on_a_long_file_and_a_big_class(tmp_path):
    pkg = _write(tmp_path, {"__init__.py": "", "a.py": "x = 1\n" * 5})
    assert oversized(pkg, max_lines=5, max_methods=2) == []
    (pkg / "a.py").write_text("x = 1\n" * 6)
    (pkg / "b.py").write_text("class Big:\n" + "".join(f"    def m{i}(self): ...\n" for i in range(3)))
    assert oversized(pkg, max_lines=5, max_methods=2) == [
        "a.py has 6 lines (at most 5: split it by concept)",
        "b.py: class Big has 3 methods (at most 2)",
    ]


@pytest.mark.parametrize(
    "token, ok",
    [
        ("low/a.py", True),
        ("a.py", True),
        ("low/", True),
        ("low/gone.py", False),  # a file that moved
        ("gone.py", False),
        ("pkg.low.a.helper", True),
        ("pkg.low.a.gone", False),
        ("a.helper", True),  # a module by its last name
        ("a.helper()", True),
        ("a.gone()", False),
        ("Thing.run", True),
        ("Thing.size", True),  # set in a method
        ("Child.run", True),  # from a base class
        ("Thing.gone", False),
        ("_helper", False),  # a private name that is nowhere
        ("_gone.agree", False),
        ("helper", True),
        ("rename_me()", False),  # a function that is nowhere
        ("len()", True),
        ("unused-parameters", True),  # a finding code
        ("unused-parameter", False),
        ("optimizer.step()", True),  # a name the code uses, not ours
        ("x + 1", True),  # not a name
    ],
)
def test_the_name_checker_fails_on_a_name_that_is_nowhere(tmp_path, token, ok):
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": (
                "def helper(optimizer):\n    optimizer.step()\n\n"
                "class Thing:\n    def run(self):\n        self.size = 1\n\n"
                "class Child(Thing):\n    pass\n"
            ),
        },
    )
    doc = pkg / "low" / "doc.py"
    doc.write_text(f'"""See `{token}`."""\n')
    found = stale_names(Index(pkg, "pkg"), docs_and_docstrings(pkg))
    assert (found == []) is ok, found
