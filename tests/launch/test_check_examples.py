"""`ddp-doctor check` on every bundled example, as a subprocess: exact codes, named params, exit code, no
leftover process; then the recommendation, passed back with --ddp-kwargs, must leave no error-level finding."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from checkrun import EXAMPLES, check
from golden import assert_matches_golden

# An example whose observed steps end early (a crash) gets its recommendation verified by check's own second run,
# and the test applies it once more: three runs of the script.
pytestmark = pytest.mark.timeout(300)


@dataclass
class Example:
    script: str
    codes: set[str]
    rc: int
    params: dict[str, set[str]] = field(default_factory=dict)
    code_fix: list[str] | None = None
    """Script arguments that fix what no DDP flag can (the bypass)."""
    detail: dict[str, str] = field(default_factory=dict)
    """Text a finding's detail must contain (where in the user's code it comes from)."""
    compared: dict[str, object] = field(default_factory=dict)
    """What the report must say it compared (a subset of its `compared` counts)."""


HEAD = {f"regress.{i}.{k}" for i in (0, 2) for k in ("weight", "bias")}
EXAMPLES_EXPECTED = [
    Example(
        "clean.py",
        set(),
        0,
        # 3 Linear layers and a LayerNorm: 8 parameters; the Sequential, its 6 children: 7 modules.
        compared={
            "ranks": 2,
            "steps": 8,
            "parameters": 8,
            "created_after_wrap": 0,
            "modules": 7,
            "inputs": 8,
            "optimizer_steps": 8,
            "collectives": 0,
            "gradients_at": "optimizer.step()",
        },
    ),
    Example(
        "unused_head.py",
        {"reduction-error", "unused-parameters", "grads-not-synced", "replica-divergence"},
        1,
        params={"unused-parameters": HEAD, "reduction-error": HEAD},
    ),
    Example("find_unused_all_used.py", {"find-unused-unneeded"}, 0),
    Example(
        "curriculum_through_module.py",
        {"wrapper-bypass", "grads-not-synced", "replica-divergence"},
        1,
        params={"wrapper-bypass": {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}},
        code_fix=["--through-ddp"],
        detail={"wrapper-bypass": "Called from examples/curriculum_through_module.py:51."},
    ),
    Example(
        "progressive_freeze.py",
        {"reduction-error", "frozen-after-wrap", "grads-not-synced", "replica-divergence"},
        1,
        params={
            "frozen-after-wrap": {"layers.0.weight", "layers.0.bias"},
            "reduction-error": {"layers.0.weight", "layers.0.bias"},
        },
    ),
    Example(
        "dynamic_graph.py",
        {"static-graph-unsafe", "dynamic-graph", "grads-not-synced", "replica-divergence"},
        1,
        params={
            "dynamic-graph": {"aux_head.weight", "aux_head.bias"},
            "static-graph-unsafe": {"aux_head.weight", "aux_head.bias"},
        },
    ),
    # The used set differs by rank but never changes: static_graph=True is the cheaper correct flag.
    Example(
        "rank_dependent_head.py",
        {"rank-dependent-graph"},
        0,
        params={"rank-dependent-graph": {"aux_head.weight", "aux_head.bias"}},
    ),
]


@pytest.mark.parametrize("example", EXAMPLES_EXPECTED, ids=lambda e: e.script)
def test_check_example_then_apply_the_recommendation(example: Example, tmp_path: Path) -> None:
    script = str(EXAMPLES / example.script)
    first = check(["--nproc-per-node", "2", script], tmp_path / "first", timeout=240)
    assert first.report is not None, first.output
    assert first.codes == example.codes, first.output
    assert first.rc == example.rc, first.output
    for code, names in example.params.items():
        assert first.params(code) == names, (code, first.output)
    for code, text in example.detail.items():
        assert text in first.finding(code)["detail"], (code, first.output)
    assert first.report["world_size"] == 2 and first.report["backend"] == "gloo"
    assert first.report["ddp_site"].startswith(f"examples/{example.script}:"), first.report["ddp_site"]
    for key, value in example.compared.items():
        assert first.report["compared"][key] == value, (key, first.report["compared"])
    assert_matches_golden(Path(example.script).stem, first.report)

    rec = first.report["recommendation"]
    kwargs = {
        "find_unused_parameters": rec["find_unused_parameters"],
        "static_graph": rec["static_graph"],
        "freeze_before_wrap": rec["freeze_before_wrap"],
    }
    second = check(["--nproc-per-node", "2", "--ddp-kwargs", json.dumps(kwargs), script], tmp_path / "second")
    assert second.report is not None, second.output
    if example.code_fix is None:
        assert second.errors() == [], second.output
        assert second.rc == 0, second.output
        assert second.report["steps_observed"] == 8
        # The second run's claim rests on what it compared: every step, every parameter DDP syncs.
        assert second.report["compared"]["steps"] == 8 and second.report["compared"]["parameters"] > 0
        return
    # No flag fixes a bypassed wrapper: the report must keep saying so, and the code fix must be clean.
    assert "wrapper-bypass" in second.errors(), second.output
    fixed = check(["--nproc-per-node", "2", script, *example.code_fix], tmp_path / "fixed")
    assert fixed.errors() == [] and fixed.rc == 0, fixed.output


@pytest.mark.parametrize("script", ["uneven_inputs.py", "observe_unused_head.py"])
def test_check_report_is_unchanged(script: str, tmp_path: Path) -> None:
    """The examples not covered above: the whole JSON report is the golden one."""
    run = check(["--nproc-per-node", "2", str(EXAMPLES / script)], tmp_path, timeout=240)
    assert run.report is not None, run.output
    assert_matches_golden(Path(script).stem, run.report)
