"""One road for a finding (issue #33): the analysis decides every finding and returns one `Diagnosis` per kind of
input; launch gathers the inputs and calls it; `ReportData.build` is the one constructor of a report; nothing edits
a diagnosis or a report after it is made; the renderers read the report's data without importing the model that
calls them. Checked on the source (ast), and on the pure entries with hand-built inputs; the frozen types refuse an
edit at run time."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from ddp_doctor.analyze import diagnose_following, diagnose_unwrapped, diagnose_verified
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Diagnosis, Finding, ParamRef, Recommendation, Timing
from ddp_doctor.core.following import FollowSummary
from ddp_doctor.core.unwrapped_run import UnwrappedRun
from ddp_doctor.report import Report, RunFacts
from ddp_doctor.report.words import WORDS

SRC = Path(__file__).resolve().parents[2] / "src" / "ddp_doctor"


def _modules(folder: Path = SRC) -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(folder.rglob("*.py"))]


def _called(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def test_a_report_is_constructed_only_by_build() -> None:
    """No `Report(...)` or `ReportData(...)` anywhere in the package; `cls(...)` in report/data.py only in `build`
    (`from_dict` reads the JSON back through `build`)."""
    calls = [
        f"{p.relative_to(SRC)}:{n.lineno}"
        for p, tree in _modules()
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _called(n) in ("Report", "ReportData")
    ]
    assert calls == [], calls
    data = ast.parse((SRC / "report" / "data.py").read_text())
    (report_data,) = [c for c in data.body if isinstance(c, ast.ClassDef) and c.name == "ReportData"]
    owners = [
        fn.name
        for fn in ast.walk(report_data)
        if isinstance(fn, ast.FunctionDef)
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "cls"
    ]
    assert owners == ["build"], owners


def test_the_recommendation_code_is_rendered_in_one_place() -> None:
    """`render_snippets` is called by `with_code` only (analyze/snippets.py): the analysis renders the code before it
    returns a diagnosis, bench renders its verdict through `with_code`; no one fills in `render` later."""
    calls = [
        f"{p.relative_to(SRC)}:{n.lineno}"
        for p, tree in _modules()
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _called(n) == "render_snippets"
    ]
    assert len(calls) == 1 and calls[0].startswith("analyze/snippets.py:"), calls


def test_launch_decides_no_finding_and_calls_the_analysis_through_its_front_door() -> None:
    """launch builds no finding, recommendation or diagnosis, and imports the analysis only as `ddp_doctor.analyze`
    (its entries), never a module of it."""
    built, reached = [], []
    for p, tree in _modules(SRC / "launch"):
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and _called(n) in ("Finding", "Recommendation", "Diagnosis", "unknown"):
                built.append(f"{p.name}:{n.lineno} {_called(n)}")
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("ddp_doctor.analyze."):
                reached.append(f"{p.name}: {n.module}")
            if isinstance(n, ast.Import) and any(a.name.startswith("ddp_doctor.analyze.") for a in n.names):
                reached.append(f"{p.name}: import")
    assert built == [] and reached == [], (built, reached)


def test_the_renderers_read_the_data_and_never_import_the_model() -> None:
    """report/model.py calls text.py and html.py; they import `report/data.py` only (no circle, not even under
    TYPE_CHECKING)."""
    for name in ("text.py", "html.py", "plots.py"):
        tree = ast.parse((SRC / "report" / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "ddp_doctor.report.model" not in imported and "ddp_doctor.report" not in imported, (name, imported)


def _rec(**kw) -> Recommendation:
    base = dict(
        find_unused_parameters=False,
        static_graph=True,
        gradient_as_bucket_view=False,
        freeze_before_wrap=[],
        reason="R.",
        verified=False,
    )
    return Recommendation(**{**base, **kw})


def _diagnosis(findings: list[Finding] | None = None) -> Diagnosis:
    return Diagnosis(findings=findings or [], recommendation=_rec(), timing=Timing(), steps_observed=2)


def _finding(code: str, severity: str) -> Finding:
    return Finding(code=code, severity=severity, title=code, detail="d")


def test_a_diagnosis_and_its_report_are_frozen() -> None:
    d = _diagnosis()
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.findings = []  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.recommendation.reason = "edited"  # type: ignore[misc]
    report = Report.build(RunFacts(torch_version="2.x", backend="gloo", world_size=2, ddp_config={}), d)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.findings = []  # type: ignore[misc]
    assert report.diagnosis == d and Report.build(report.facts, report.diagnosis) == report
    assert Report.from_dict(report.to_dict()) == report


def test_following_gives_a_new_diagnosis_in_severity_order_and_leaves_the_steps_one_alone() -> None:
    steps = _diagnosis([_finding("unused-parameters", "error"), _finding("rank-dependent-graph", "info")])
    loader = {
        "site": "eval.py:3",
        "training": False,
        "capped": 1,
        "no_len": True,
        "batches": {"min": None, "max": None},
        "counted": {"uneven": True, "pass": 1, "min": 4, "max": 5, "by_rank": [5, 4], "at_least_by_rank": [0, 0]},
    }
    summary = FollowSummary(
        followed=True, declined=False, epoch_ends=1, ended_by="x", seconds=1.0, loaders=[loader], counts={}
    )
    after = diagnose_following(steps, summary, framework="torch", epochs=1, limit=2, followed=True)
    assert [f.code for f in steps.findings] == ["unused-parameters", "rank-dependent-graph"]
    assert steps.following is None
    assert [(f.code, f.severity) for f in after.findings] == [
        ("unused-parameters", "error"),
        ("uneven-inputs", "warning"),
        ("rank-dependent-graph", "info"),
    ]
    assert after.following is not None and after.following.epoch_ends == 1


def test_verification_gives_a_new_recommendation() -> None:
    first = _diagnosis()
    clean = _diagnosis()
    done = diagnose_verified(first, applied='{"static_graph": true}', needed=2, second=clean)
    assert done.recommendation.verified and done.recommendation.verification["outcome"] == "verified"
    assert done.recommendation.verification["ddp_kwargs"] == '{"static_graph": true}'
    assert not first.recommendation.verified and first.recommendation.verification is None
    failed = diagnose_verified(first, applied="{}", needed=3, second=_diagnosis([_finding("rank-crashed", "error")]))
    assert not failed.recommendation.verified and failed.recommendation.verification["outcome"] == "refuted"
    assert failed.recommendation.verification["errors"] == ["rank-crashed"]
    assert not failed.recommendation.flags_known  # proven wrong: withdrawn
    none = diagnose_verified(first, applied="{}", needed=2, second=None, error="no rank started")
    assert none.recommendation.verification["outcome"] == "not-run"
    assert none.recommendation.verification["error"] == "no rank started"
    assert {d.recommendation.reason for d in (done, failed, none)} == {"R."}  # the analysis' words, never edited


def test_an_unwrapped_run_is_diagnosed_from_its_typed_record() -> None:
    run = UnwrappedRun(
        world=2,
        steps=3,
        optimizer="SGD",
        optimizer_site="t.py:5",
        params=[ParamRef("w", 4), ParamRef("b", 2)],
        differ=[True, False],
        gap=0.5,
    )
    d = diagnose_unwrapped(run)
    (f,) = d.findings
    assert (f.code, f.severity, f.param_names, f.steps) == ("model-not-wrapped", "error", ["w"], [0, 1, 2])
    assert "0.5" in f.detail and not d.recommendation.flags_known and d.steps_observed == 3
    assert diagnose_unwrapped(dataclasses.replace(run, params=[], differ=[])).findings == []


CHECK_ENTRIES = {"sharded_protocol", "unwrapped_rounds"}
"""The exchanges that launch and doctor drive themselves (DDP's `protocol` and the epoch end's `follow_rounds` are
driven inside exchange/, by `runner.exchange` and `exchange_follow`)."""
PRIMITIVES = {"minmax", "agree", "name_flagged", "odd_ranks", "pick"}
"""exchange/'s functions that make a collective of their own, for guard, refreeze and `sync_gradients`."""


def test_every_collective_of_the_check_is_a_listed_round() -> None:
    """The check's own code (launch/, doctor/, observation/) reaches the other ranks only by driving a listed round
    (`exchange/control.py`'s `ROUNDS`, a sharded model's or an unwrapped run's exchange), never through a primitive
    that makes a collective of its own; and every control round is in that module's table."""
    from ddp_doctor.exchange import control

    listed = CHECK_ENTRIES | set(control.ROUNDS)
    found, driven = [], set()
    for folder in ("launch", "doctor", "observation"):
        for p, tree in _modules(SRC / folder):
            for n in ast.walk(tree):
                if not isinstance(n, ast.Call):
                    continue
                where = f"{p.relative_to(SRC)}:{n.lineno}"
                if _called(n) in PRIMITIVES:
                    found.append(f"{where} {_called(n)}")
                if _called(n) == "drive":
                    first = n.args[0] if n.args else None
                    name = _called(first) if isinstance(first, ast.Call) else ""
                    driven.add(name)
                    if name not in listed:
                        found.append(f"{where} drive({ast.unparse(first) if first else ''})")
    assert found == [], found
    assert set(control.ROUNDS) <= driven, driven  # each control round is one the check makes
    table = control.__doc__ or ""
    assert all(f"| `{name}` |" in table for name in control.ROUNDS), table


_WORDS = {"title", "detail", "fix", "reason"}
"""A finding's and a recommendation's sentences."""


def _reads_or_edits_words(n: ast.AST) -> bool:
    def words(x: ast.AST) -> bool:
        return isinstance(x, ast.Attribute) and x.attr in _WORDS

    if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        return any(words(t) for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
    if isinstance(n, ast.Compare):
        return any(words(side) for side in (n.left, *n.comparators))
    if isinstance(n, ast.Call):
        method_of_words = isinstance(n.func, ast.Attribute) and words(n.func.value)
        rewords = _called(n) == "replace" and any(k.arg in _WORDS for k in n.keywords)
        return method_of_words or rewords
    if isinstance(n, ast.JoinedStr) or isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
        # a finding's words pasted into other words (`f"...{failed[0].title}"`, `x.detail + " "`)
        parts = (
            [v.value for v in n.values if isinstance(v, ast.FormattedValue)]
            if isinstance(n, ast.JoinedStr)
            else [n.left, n.right]
        )
        return any(words(p) and p.attr != "reason" for p in parts)
    if isinstance(n, ast.IfExp):  # a finding's words chosen as other words (`what = f.title if f else ...`)
        return any(words(side) and side.attr != "reason" for side in (n.body, n.orelse))
    return False


def test_no_analysis_code_reads_or_edits_a_sentence() -> None:
    """The analysis, the in-process doctor and the launch decide on facts: none of them compares a finding's or a
    recommendation's words, calls a method of them (`.replace`, `.split`, `startswith`) or sets them after the
    finding was made (`f.fix = ...`, `replace(rec, reason=...)`), or pastes them into other words (an error, a note:
    report/ writes a finding into sentences, `report.text.finding_sentences`). A fix that depends on the other findings is decided
    by a detector that reads their codes (`detects(..., reads_found=True)`); a verification's outcome is typed
    (`reshard["verification"]`) and worded by report/."""
    hits = [
        f"{p.relative_to(SRC)}:{n.lineno} {ast.unparse(n)[:60]}"
        for folder in ("analyze", "doctor", "launch", "exchange", "observation")
        for p, tree in _modules(SRC / folder)
        for n in ast.walk(tree)
        if _reads_or_edits_words(n)
    ]
    assert hits == [], hits


_COLLECTIVES = {
    *("all_reduce", "allreduce", "all_gather", "allgather", "all_gather_object", "all_gather_into_tensor"),
    *("broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter"),
    *("reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter"),
    *("scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list"),
    "recv_object_list",
}
"""The functions of `torch.distributed` that communicate (and a process group's own methods of those names)."""

_MAY_COMMUNICATE = ("exchange/", "fixes/sync.py")
"""Where the check's own collectives live: the exchange's rounds, and the fix that syncs replicas on request."""


def _collective_calls(folder: Path) -> list[str]:
    """Each call of a communicating function under `folder`, as `file:line call`: `dist.all_reduce(...)`,
    `pg.allreduce(...)`, or a name imported from `torch.distributed` (`from torch.distributed import barrier`)."""
    hits = []
    for p, tree in _modules(folder):
        imported = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torch.distributed")
            for a in n.names
            if a.name in _COLLECTIVES
        }
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in _COLLECTIVES or isinstance(f, ast.Name) and f.id in imported:
                hits.append(f"{p.relative_to(folder).as_posix()}:{n.lineno} {ast.unparse(f)}")
    return hits


def test_only_the_exchange_and_the_sync_fix_communicate() -> None:
    """Every collective the check makes is a round of exchange/ (listed, simulated at 1,024 ranks, covered by the
    signature test), for DDP, FSDP2 and `replicate` alike; the one other caller is fixes/sync.py, which syncs a
    user's replicas when asked. Observation wraps the user's collectives and calls the originals it saved, never a
    collective of its own."""
    outside = [hit for hit in _collective_calls(SRC) if not hit.startswith(_MAY_COMMUNICATE)]
    assert outside == [], outside
    assert any(hit.startswith("exchange/") for hit in _collective_calls(SRC))  # the scan sees the exchange's own


def test_the_collective_scan_finds_each_way_of_calling_one(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "import torch.distributed as dist\nfrom torch.distributed import barrier as wait\n"
        "def f(t, pg):\n    dist.all_reduce(t)\n    pg.allgather([t], [t])\n    wait()\n"
        "    s = f'dist.broadcast(t, 0)'\n"
    )
    assert _collective_calls(tmp_path) == ["a.py:4 dist.all_reduce", "a.py:5 pg.allgather", "a.py:6 wait"]


def test_the_codes_the_report_words_are_built_without_words() -> None:
    """A code whose sentences report/words.py writes from the evidence is never built with a title or a detail
    of its own, anywhere in the package: its words are in one place, and the evidence alone must carry what they
    say (every finding of it goes through `ReportData.build`, which words it)."""
    names = {c.name for c in Code if str(c) in WORDS}
    builds = [
        (f"{p.relative_to(SRC)}:{n.lineno}", k.value.attr, {w.arg for w in n.keywords})
        for p, tree in _modules()
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _called(n) == "Finding"
        for k in n.keywords
        if k.arg == "code" and isinstance(k.value, ast.Attribute) and k.value.attr in names
    ]
    worded = [site for site, _, keywords in builds if keywords & {"title", "detail"}]
    assert worded == [], worded
    assert {code for _, code, _ in builds} == names  # every code the report words is built somewhere
