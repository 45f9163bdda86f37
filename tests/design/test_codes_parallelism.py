"""Which parallelism's check decides each code (`CodeInfo.checked_for`), and which checks a parallelism's report says
it does not make (`CodeInfo.not_checked_for`, the report's `compared.codes_not_checked`). The table is held to the
code: a code said to be checked for FSDP2 is built on the road a sharded model's report takes, a code said to be
checked for DDP is built on DDP's, and a check said not to be made for a parallelism is not built on its road (so
the report never says "not checked" of a check it makes, nor stays silent about one it does not)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddp_doctor.analyze import detectors as _registered  # noqa: F401  (registers every detector)
from ddp_doctor.analyze.sharded_coverage import sharded_compared
from ddp_doctor.analyze.view import detectors
from ddp_doctor.core.codes import PARALLELISMS, TABLE, Code, not_checked_for
from ddp_doctor.core.sharded_run import ShardedRun
from ddp_doctor.report.claims import compared_line

ANALYZE = Path(__file__).resolve().parents[2] / "src" / "ddp_doctor" / "analyze"
_TREES = {p.stem: ast.parse(p.read_text()) for p in ANALYZE.glob("*.py")}
_FUNCTIONS = {(m, n.name): n for m, tree in _TREES.items() for n in tree.body if isinstance(n, ast.FunctionDef)}


def _imported(module: str) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """The functions of analyze/ that `module` imports by name, and the modules of analyze/ it imports whole
    (`from ddp_doctor.analyze import rules`), by the names it binds them to."""
    functions, modules = {}, {}
    for node in _TREES[module].body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddp_doctor.analyze."):
            for alias in node.names:
                functions[alias.asname or alias.name] = (node.module.rsplit(".", 1)[-1], alias.name)
        if isinstance(node, ast.ImportFrom) and node.module == "ddp_doctor.analyze":
            modules.update({alias.asname or alias.name: alias.name for alias in node.names if alias.name in _TREES})
    return functions, modules


def built_from(*entries: tuple[str, str]) -> set[str]:
    """The codes of the findings built by the functions of analyze/ that `entries` reach (a call, or a function
    passed on by name), read from the source: a function that calls `Finding(...)` builds the `Code`s it names.
    `links.py` only links findings already built."""
    seen: set[tuple[str, str]] = set()
    todo, codes = list(entries), set()
    while todo:
        key = todo.pop()
        if key in seen or key[0] == "links":
            continue
        seen.add(key)
        fn, (imported, whole) = _FUNCTIONS[key], _imported(key[0])
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Finding" for n in ast.walk(fn)):
            codes |= {
                n.attr
                for n in ast.walk(fn)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "Code"
            }
        for n in ast.walk(fn):
            if isinstance(n, ast.Name):
                target = (key[0], n.id) if (key[0], n.id) in _FUNCTIONS else imported.get(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in whole:
                target = (whole[n.value.id], n.attr)  # `rules.sampler_epoch_repeated(...)`
            else:
                continue
            if target in _FUNCTIONS:
                todo.append(target)
    return {str(getattr(Code, name)) for name in codes}


SHARED = built_from(("failures", "failure_findings"), ("following_ends", "following_findings"))
"""A failed run's findings and the epoch ends followed: one road whatever the parallelism."""
SHARDED = {str(code) for code, _ in detectors("sharded")} | built_from(("diagnose", "diagnose_sharded"))
"""The sharded model's detectors (FSDP2 and `replicate`), and whatever `diagnose_sharded` builds itself."""
DDP = {str(code) for code, _ in detectors()} | built_from(("diagnose", "diagnose_unwrapped"))
"""DDP's detectors of the exchanged records, and a run without any wrapper."""


@pytest.mark.parametrize("parallelism", list(PARALLELISMS))
def test_a_code_said_checked_for_a_parallelism_is_built_on_its_road(parallelism: str) -> None:
    road = (DDP if parallelism == "ddp" else SHARDED) | SHARED
    said = {str(row.code) for row in TABLE if parallelism in row.checked_for}
    assert said - road == set(), f"said checked for {parallelism}, built nowhere on its road: {sorted(said - road)}"


@pytest.mark.parametrize("parallelism", list(PARALLELISMS))
def test_a_check_said_not_made_for_a_parallelism_is_not_built_on_its_road(parallelism: str) -> None:
    road = (DDP if parallelism == "ddp" else SHARDED) | SHARED
    said = {str(code) for code in not_checked_for(parallelism)}
    assert said & road == set(), f"said not checked for {parallelism}, but built on its road: {sorted(said & road)}"


def test_a_check_not_made_for_a_parallelism_is_made_by_the_one_its_report_names() -> None:
    """The report says "Not checked for FSDP2 (DDP's check makes them)", and for DDP, "FSDP2's": true of each code
    it lists."""
    for row in TABLE:
        for parallelism in row.not_checked_for:
            maker = "fsdp2" if parallelism == "ddp" else "ddp"
            assert maker in row.checked_for, (row.code, parallelism, row.checked_for)


def test_every_code_built_on_a_road_is_said_checked_for_it() -> None:
    """The other way round: a detector of DDP's or a finding of the sharded road whose row leaves that parallelism
    out would make the report say nothing of a check it makes (and the docs' column be wrong)."""
    ddp = {str(row.code) for row in TABLE if "ddp" in row.checked_for}
    sharded = {str(row.code) for row in TABLE if "fsdp2" in row.checked_for}
    assert DDP - ddp == set(), sorted(DDP - ddp)
    assert SHARDED - sharded == set(), sorted(SHARDED - sharded)


def test_the_tracer_finds_a_code_built_two_calls_down() -> None:
    """A road is read from its registered detectors and through the functions its entries call: the epoch ends'
    `sampler-epoch-not-set` is built by `rules.sampler_epoch_repeated`, which `epochs.followed_epoch_repeated`
    calls."""
    assert "buffer-divergence" in SHARDED and "gradient-sync-off" in SHARDED and "dynamic-graph" not in SHARDED
    assert "rank-hung" in SHARED and "uneven-inputs" in SHARED
    assert "sampler-epoch-not-set" in SHARED  # `epochs.followed_epoch_repeated` -> `rules.sampler_epoch_repeated`


def test_the_report_names_the_checks_not_made_for_its_parallelism() -> None:
    """A DDP report's and a sharded one's `compared` carry the codes; the text says which parallelism's check makes
    them."""
    for api, parallelism in (("fully_shard", "fsdp2"), ("replicate", "replicate")):
        run = ShardedRun(world=2, steps=4, optimizer="SGD", optimizer_site=None, sharding={"api": api}, model_params=4)
        c = sharded_compared(run)
        assert c["codes_not_checked"] == [str(code) for code in not_checked_for(parallelism)] != [], c
        assert "grads-reduced-twice" in c["codes_not_checked"]
        assert ("frozen-after-wrap" in c["codes_not_checked"]) == (parallelism == "replicate")
        assert compared_line(c).endswith(f"`{c['codes_not_checked'][-1]}`.")
    ddp = {"ranks": 2, "steps": 0, "codes_not_checked": ["low-precision-weights"]}
    assert compared_line(ddp).endswith("Not checked for DDP (FSDP2's check makes them): `low-precision-weights`.")
