"""One table of codes (`core/codes.py`): every module names a code through `Code`, the table says where and at which
severities each code is built, and the README's and docs/codes.md's tables are drawn from it.

The scanner of bare code strings is tested on a file written to `tmp_path`, so it is known to fail when it should.
`python tests/design/test_codes.py` rewrites the two drawn tables after a change to the table."""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ddp_doctor
from ddp_doctor import CODES
from ddp_doctor.cli.list_codes import BEGIN, END, markdown
from ddp_doctor.core.codes import FAMILY_TITLES, REPORT_ORDER, SEVERITIES, TABLE, Code, Family, info
from ddp_doctor.core.findings import Finding

PACKAGE = Path(ddp_doctor.__file__).parent
REPO = PACKAGE.parents[1]
ANALYZE = PACKAGE / "analyze"

DESIGN = REPO.parent / "shared" / "DESIGN.md"
"""The JSON contract (../shared/DESIGN.md, 2.3): the codes it names may never be renamed or removed."""

ALLOWED: dict[tuple[str, str], str] = {}
"""(path under the package, string) -> why a string equal to a code is not a code there. None today: the crash kind
and the exchange predicate that share a code's name are spelled through `Code` (core/records.py, exchange/summary.py)."""


def bare_codes(root: Path, codes: set[str], *, allowed: dict[tuple[str, str], str] | None = None) -> list[str]:
    """`path:line: 'code'` for each string constant under `root` equal to one of `codes`, outside core/codes.py."""
    allowed = allowed or {}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "core/codes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and node.value in codes and (rel, node.value) not in allowed:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_no_bare_code_strings_in_the_package() -> None:
    found = bare_codes(PACKAGE, set(CODES), allowed=ALLOWED)
    assert not found, "name these codes through ddp_doctor.core.codes.Code:\n" + "\n".join(found)


def test_the_scanner_finds_a_bare_code(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "codes.py").write_text('UNUSED = "unused-parameters"\n')  # the table itself may
    (tmp_path / "rule.py").write_text(
        'from x import Code\n\nok = Code.UNUSED_PARAMETERS\ntext = "unused-parameters are bad"\nbad = {"rank-hung": 1}\n'
    )
    codes = {"unused-parameters", "rank-hung"}
    assert bare_codes(tmp_path, codes) == ["rule.py:5: 'rank-hung'"]
    assert bare_codes(tmp_path, codes, allowed={("rule.py", "rank-hung"): "a test"}) == []


def test_the_codes_the_design_names_are_all_there() -> None:
    if not DESIGN.is_file():
        pytest.skip(f"{DESIGN} is not beside the repository (CI puts ../shared there)")
    named = set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`", DESIGN.read_text())) - {"ddp-doctor"}
    missing = named - {c.value for c in Code}
    assert not missing, f"renamed or removed (or a new backquoted name in DESIGN.md that is not a code): {missing}"


def test_each_code_is_spelled_out_by_a_test_of_its_finding() -> None:
    """A code's own test spells its string (`assert codes == {"grad-blocked"}`), so renaming a code fails a test of
    the reports it is in, not only this file."""
    texts = [p.read_text() for p in REPO.joinpath("tests").rglob("*.py") if p.name != Path(__file__).name]
    unspelled = [c.value for c in Code if not any(f'"{c.value}"' in t for t in texts)]
    assert not unspelled, f"no test spells these codes: {unspelled}"


def test_each_code_is_its_string() -> None:
    assert list(CODES) == [c.value for c in Code] == [row.code.value for row in TABLE]
    for code in Code:
        assert code == code.value and hash(code) == hash(code.value) and f"{code}" == str(code) == code.value
        assert json.dumps({code: [code]}) == json.dumps({code.value: [code.value]})
        assert info(code.value) is info(code)
    with pytest.raises(AttributeError):
        Code.UNUSED_PARAMETER  # noqa: B018 (a typo fails where it is written)


def test_a_finding_built_with_a_code_is_the_finding_read_back() -> None:
    built = Finding(code=Code.GRAD_BLOCKED, severity="error", title="t", detail="d")
    assert type(built.code) is str
    assert json.dumps(built.to_dict()) == json.dumps(
        Finding(code="grad-blocked", severity="error", title="t", detail="d").to_dict()
    )


def test_every_row_is_complete() -> None:
    assert set(FAMILY_TITLES) == set(Family)
    for row in TABLE:
        assert row.summary and row.severities and set(row.severities) <= set(SEVERITIES), row.code
        for module in row.decided_in:
            assert (ANALYZE / module).is_file(), f"{row.code}: analyze/{module} does not exist"


# ------------------------------------------------------------------------------ the table against the detectors


def _code_names(node: ast.expr) -> list[str]:
    """`Code.X` -> ["X"]; `Code.X if c else Code.Y` -> ["X", "Y"]; anything else (a variable) -> []."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Code":
        return [node.attr]
    if isinstance(node, ast.IfExp):
        return _code_names(node.body) + _code_names(node.orelse)
    return []


def _literals(node: ast.expr) -> list[str]:
    """`"error"` -> ["error"]; `"error" if c else "warning"` -> both; a variable -> []."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _literals(node.body) + _literals(node.orelse)
    return []


def _findings_built(tree: ast.AST) -> Iterator[tuple[ast.Call, list[str], list[str]]]:
    """Each `Finding(code=..., severity=...)` call: the codes it may build and the severities spelled out in it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Finding":
            kw = {k.arg: k.value for k in node.keywords}
            if "code" in kw:
                yield node, _code_names(kw["code"]), _literals(kw["severity"]) if "severity" in kw else []


def _rule_codes() -> dict[str, set[str]]:
    """analyze/rules.py: builder function -> the codes it builds (guard builds them with the same function)."""
    tree = ast.parse((ANALYZE / "rules.py").read_text())
    out: dict[str, set[str]] = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            out[fn.name] = {name for _, names, _ in _findings_built(fn) for name in names}
    return out


def built_where() -> dict[str, set[str]]:
    """Code name -> the analyze modules that build it, directly or through a builder of rules.py."""
    rules = _rule_codes()
    where: dict[str, set[str]] = {}
    for path in sorted(ANALYZE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for _, names, _ in _findings_built(tree):
            for name in names:
                where.setdefault(name, set()).add(path.name)
        for node in ast.walk(tree):
            called = node.func if isinstance(node, ast.Call) else None
            if isinstance(called, ast.Attribute) and isinstance(called.value, ast.Name) and called.value.id == "rules":
                for name in rules.get(called.attr, ()):
                    where.setdefault(name, set()).add(path.name)
    return where


def test_the_table_says_where_each_code_is_decided() -> None:
    where = built_where()
    rules = {name for names in _rule_codes().values() for name in names}
    for row in TABLE:
        built = where.get(row.code.name, set()) - {"rules.py"}
        # crashed_ranks.py also builds whatever code DDP's explained error carries (`code=crash.explained.code`).
        listed = set(row.decided_in) - ({"crashed_ranks.py"} - built)
        assert built == listed, f"{row.code}: built in {sorted(built)}, the table says {sorted(row.decided_in)}"
        assert row.guard == (row.code.name in rules), f"{row.code}: guard={row.guard}, but rules.py disagrees"


SEVERAL_SOURCES: dict[str, int] = {}
"""Codes still decided in more than one module (none: `collective-mismatch`, the last, is decided in
collective_order.py from every source). The count may only go down."""


def test_each_concept_is_decided_in_one_module() -> None:
    """One module decides each code, whatever the parallelism or the source of its facts (a run that completed,
    one that failed, one followed). crashed_ranks.py does not count: it passes on DDP's own error as the failed rank
    explained it, with the code that rank's rules gave."""
    for row in TABLE:
        modules = set(row.decided_in) - {"crashed_ranks.py"} or set(row.decided_in)
        assert len(modules) <= SEVERAL_SOURCES.get(row.code.name, 1), f"{row.code}: decided in {sorted(modules)}"


def _built_by(tree: ast.Module, name: str, rules: dict[str, set[str]], seen: set[str]) -> set[str]:
    """The codes function `name` of a module builds: itself, through rules.py, or through the module's helpers."""
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if name in seen or name not in functions:
        return set()
    seen.add(name)
    built = {code for _, names, _ in _findings_built(functions[name]) for code in names}
    for node in ast.walk(functions[name]):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "rules":
            built |= rules.get(f.attr, set())
        elif isinstance(f, ast.Name):
            built |= _built_by(tree, f.id, rules, seen)
    return built


def test_each_detector_builds_the_code_it_is_registered_for() -> None:
    from ddp_doctor.analyze.detectors import DETECTORS, SHARDED_DETECTORS
    from ddp_doctor.analyze.view import ROADS, detectors

    assert [fn for _, fn in detectors("ddp")] == list(DETECTORS) and len(DETECTORS) > 30
    assert [fn for _, fn in detectors("sharded")] == list(SHARDED_DETECTORS) and len(SHARDED_DETECTORS) > 20
    rules = _rule_codes()
    for road in ROADS:
        registered = detectors(road)
        assert [code for code, _ in registered] == sorted((c for c, _ in registered), key=REPORT_ORDER.index)
        for code, fn in registered:
            tree = ast.parse(Path(sys.modules[fn.__module__].__file__).read_text())
            assert _built_by(tree, fn.__name__, rules, set()) == {code.name}, f"{fn.__name__} is registered for {code}"


def test_each_code_is_detected_in_its_own_module_on_every_road() -> None:
    """A code checked for DDP and for a sharded model has a detector on each road, and both live in the module its
    row names: one module decides each concept, the parallelism an input to it (no `sharded_*` copy of a rule)."""
    from ddp_doctor.analyze.view import ROADS, detectors

    for road in ROADS:
        for code, fn in detectors(road):
            module = fn.__module__.rsplit(".", 1)[-1] + ".py"
            assert module in info(code).decided_in, f"{road}: {fn.__name__} ({module}) decides {code}"


def test_a_detector_of_an_unknown_road_is_refused() -> None:
    from ddp_doctor.analyze.view import detects

    with pytest.raises(ValueError, match="road='fsdp'"):
        detects(Code.UNUSED_PARAMETERS, road="fsdp")


def test_a_detector_of_a_code_outside_the_report_order_is_refused() -> None:
    from ddp_doctor.analyze.view import detects

    with pytest.raises(ValueError, match="REPORT_ORDER"):
        detects(Code.RANK_HUNG)


def test_every_severity_a_detector_spells_out_is_in_the_table() -> None:
    seen = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        for call, names, severities in _findings_built(ast.parse(path.read_text())):
            for name in names:
                allowed = info(getattr(Code, name)).severities
                for severity in severities:
                    seen += 1
                    assert severity in allowed, f"{path.name}:{call.lineno}: {name} at {severity}, table: {allowed}"
    assert seen > 50  # the scan sees the detectors


# ------------------------------------------------------------------------------------------ the drawn tables

DRAWN = {"readme": REPO / "README.md", "docs": REPO / "docs" / "codes.md"}


def _block(text: str, target: str) -> str:
    start = text.index(BEGIN.format(target=target))
    return text[start : text.index(END, start) + len(END)]


@pytest.mark.parametrize("target", sorted(DRAWN))
def test_the_drawn_tables_are_the_table(target: str) -> None:
    text = DRAWN[target].read_text()
    assert text.count(END) == 1, f"{DRAWN[target]}: one table between the markers"
    assert _block(text, target) == markdown(target), (
        f"{DRAWN[target].relative_to(REPO)} is not drawn from core/codes.py: run `python tests/design/test_codes.py`"
    )


def test_codes_markdown_command(capsys: pytest.CaptureFixture[str]) -> None:
    from ddp_doctor.cli import main

    assert main(["codes", "--markdown", "docs"]) == 0
    assert capsys.readouterr().out == markdown("docs") + "\n"


def rewrite() -> None:
    """Draw the two tables again from core/codes.py."""
    for target, path in DRAWN.items():
        text = path.read_text()
        path.write_text(text.replace(_block(text, target), markdown(target)))
        print(f"drew {path.relative_to(REPO)}")


if __name__ == "__main__":
    rewrite()
    sys.exit(0)
