"""`ddp-doctor check --html` and `demo --html` as subprocesses, their pages opened in headless Chromium: the figures
are drawn with a real size, every finding's title is on the page, the page logs nothing and loads nothing.

Set DDP_DOCTOR_SCREENSHOT_DIR to keep the usage-map screenshot of the dynamic-graph run (the README's image is
`DDP_DOCTOR_SCREENSHOT_DIR=docs pytest tests/report/test_report_pages.py -k dynamic_graph_fixed`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from browser import crop, not_blank, render
from checkrun import EXAMPLES, REPO, check


@dataclass
class Page:
    id: str
    script: str
    codes: set[str]
    """Finding codes the page must show (at least)."""
    args: list[str] = field(default_factory=list)
    patterns: int = 1
    """Distinct rank patterns in the usage map."""
    diverges: bool = False


PAGES = [
    Page(
        "dynamic_graph",
        "dynamic_graph.py",
        {"static-graph-unsafe", "dynamic-graph", "replica-divergence"},
        diverges=True,
    ),
    # The same example with the flags the report recommends: 8 steps, the auxiliary head on every other one.
    Page(
        "dynamic_graph_fixed",
        "dynamic_graph.py",
        {"dynamic-graph"},
        args=["--ddp-kwargs", '{"static_graph": false, "find_unused_parameters": true}'],
    ),
    Page("rank_dependent", "rank_dependent_head.py", {"rank-dependent-graph"}, patterns=2),
    Page(
        "bypass",
        "curriculum_through_module.py",
        {"wrapper-bypass", "grads-not-synced", "replica-divergence"},
        diverges=True,
    ),
]


@pytest.mark.parametrize("case", PAGES, ids=lambda p: p.id)
def test_check_html_page_renders_what_a_person_needs_to_see(case: Page, tmp_path: Path) -> None:
    page = tmp_path / f"{case.id}.html"
    run = check(["--nproc-per-node", "2", "--html", str(page), *case.args, str(EXAMPLES / case.script)], tmp_path)
    assert run.report is not None and page.exists(), run.output
    assert case.codes <= run.codes, run.output
    assert "wrote " in run.output, run.output
    usage, divergence = run.report["usage_map"], run.report["divergence"]
    assert len(usage["patterns"]) == case.patterns and usage["steps"] == run.report["steps_observed"]
    assert (divergence["weights_start"] is not None) == case.diverges, divergence

    shown = render(page, tmp_path)
    assert shown.probe["errors"] == [] and shown.console == [], (shown.probe["errors"], shown.console)
    for cls in ("usage-map", "divergence"):
        (figure,) = shown.figures(cls)
        assert figure["svg"] and figure["w"] > 200 and figure["h"] > 100, figure
    titles = {t["code"]: t for t in shown.probe["titles"]}
    for f in run.report["findings"]:
        title = titles[f["code"]]
        assert title["text"] == f["title"] and title["w"] > 0 and title["h"] > 0, title
    assert not_blank(shown.screenshot)
    (usage_box,) = shown.figures("usage-map")
    image = crop(shown.screenshot, usage_box, tmp_path / f"{case.id}-usage-map.png")
    assert not_blank(image)
    keep = os.environ.get("DDP_DOCTOR_SCREENSHOT_DIR")
    if keep and case.id == "dynamic_graph_fixed":
        shutil.copy(image, Path(keep) / "usage-map-dynamic-graph.png")


def test_demo_html_writes_a_page_per_example_and_an_index(tmp_path: Path) -> None:
    out = tmp_path / "pages"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp_doctor.cli",
            "demo",
            "--only",
            "clean",
            "--only",
            "rank_dependent_head",
            "--html",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.glob("*.html")) == ["clean.html", "index.html", "rank_dependent_head.html"]
    index = (out / "index.html").read_text()
    assert "href='clean.html'" in index and "href='rank_dependent_head.html'" in index
    assert "<code>rank-dependent-graph</code> (info)" in index
    clean = (out / "clean.html").read_text()
    assert "No problems found in what was compared" in clean and "Compared across 2 ranks at each of 8 steps" in clean
    shown = render(out / "index.html", tmp_path)
    assert shown.probe["errors"] == [] and shown.console == [] and not_blank(shown.screenshot)


def _help(command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", command, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


@pytest.mark.parametrize("command", ["check", "bench"])
def test_help_leads_with_our_options_and_examples_then_torchrun(command: str) -> None:
    out = _help(command)
    ours, examples, torchrun = (
        out.index(f"\n{command} options:"),
        out.index("\nexamples:"),
        out.index("\ntorchrun options:"),
    )
    assert ours < examples < torchrun, out
    mine = out[ours:examples]
    for option in (
        "--steps",
        "--json",
        "--html",
        "--timeout",
        *(("--fail-on", "--ddp-kwargs") if command == "check" else ("--rounds", "--configs")),
    ):
        assert option in mine, (option, mine)
    assert "--nproc-per-node" not in mine and "--rdzv-endpoint" in out[torchrun:]
    assert f"ddp-doctor {command} --nproc-per-node 2" in out[examples:torchrun]
