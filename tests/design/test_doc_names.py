"""Every module, file, finding code, class or function of ours named in backquotes in docs/architecture.md,
ARCHITECTURE.md and the module docstrings exists (`stale_names`): a house rule of docs/architecture.md, beside those
of tests/design/test_layers.py. The checker is tested on a small package written to `tmp_path`, so it is known to fail
when it should."""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from test_layers import REPO, ROOT, modules, write_package

from ddp_doctor.core.codes import CODES

# ------------------------------------------------------------------------------------------------ names in docs

FOREIGN = {
    # torch's, the frameworks' and a user script's names the docs quote (ours are checked, these are not)
    "Accelerator", "HierarchicalModelAverager", "DDPStrategy", "GradScaler", "PreTrainedModel", "SequentialLR", "Trainer", "TrainingArguments",
    "accelerator", "clip_grad_norm_", "clip_grad_value_", "compute_loss", "d_loss", "ddp_broadcast_buffers",
    "ddp_bucket_cap_mb", "ddp_find_unused_parameters", "ddp_static_graph", "fully_shard", "g_loss", "lightning",
    "loss_fn", "manual_backward", "max_batches", "mul_", "no_sync", "on_epoch_end", "pytorch", "pytorch_lightning",
    "reshard_after_forward", "OMP_NUM_THREADS", "PYTHON_EXEC", "register_parameter",
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


def test_every_name_in_backquotes_in_the_docs_and_docstrings_exists():
    docs = [REPO / "docs" / "architecture.md", REPO / "ARCHITECTURE.md"]
    index = Index(ROOT, "ddp_doctor", also=sorted((REPO / "tests").rglob("*.py")))
    assert stale_names(index, docs_and_docstrings(ROOT, docs)) == []


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
    pkg = write_package(
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
