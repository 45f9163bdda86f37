"""`ddp-doctor bench` on the examples, as a subprocess: the correctness verdicts (never the timings), the JSON
contract, and the HTML page rendered by headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkrun import EXAMPLES, REPO


def bench(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "ddp_doctor.cli", "bench", "--nproc-per-node", "2", "--steps", "4",
                           "--json", str(out), *args], cwd=REPO, capture_output=True, text=True, timeout=400, check=False)
    assert out.exists(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


def by_name(result: dict) -> dict[str, dict]:
    return {c["name"]: c for c in result["candidates"]}


def test_find_unused_unneeded_recommended_config_is_correct_and_page_renders(tmp_path: Path) -> None:
    page = tmp_path / "bench.html"
    done, result = bench(["--rounds", "2", "--configs", "user,recommended", "--html", str(page),
                          str(EXAMPLES / "find_unused_all_used.py")], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["schema"] == "ddp-doctor/bench@1"
    cands = by_name(result)
    assert cands["user"]["config"]["find_unused_parameters"] is True and cands["user"]["correct"]
    assert cands["recommended"]["config"]["find_unused_parameters"] is False and cands["recommended"]["correct"]
    for c in cands.values():
        assert c["median_step_s"] > 0 and len(c["rounds"]) == 2 and all(len(r) == 4 for r in c["rounds"])
        assert c["ratio_to_user"] is not None
    # Two rounds cannot show that the script's extra graph walk pays off: the least-work config is chosen, as
    # `check`'s find-unused-unneeded says, whatever the noisy timings were.
    assert result["winner"]["name"] == "recommended" and result["winner"]["measured"] is False, result["winner"]
    assert result["rounds_run"] == 2 and "skips the graph walk" in result["winner"]["reason"]
    assert cands["user"]["vs_reference"]["rounds"] == 2 and cands["recommended"]["vs_reference"] is None
    assert {f["code"] for f in result["check"]["findings"]} == {"find-unused-unneeded"}
    _render_in_chromium(page, tmp_path, names=list(cands))


def test_unused_head_default_flags_are_incorrect_and_the_fixes_are_correct(tmp_path: Path) -> None:
    done, result = bench(["--rounds", "1", "--configs", "user,recommended,static_graph,find_unused",
                          str(EXAMPLES / "unused_head.py")], tmp_path)
    cands = by_name(result)
    assert set(cands) == {"user", "recommended", "static_graph", "find_unused"}
    assert not cands["user"]["correct"] and "reduction-error" in cands["user"]["reason"]
    assert cands["user"]["median_step_s"] is None
    assert cands["recommended"]["config"]["freeze_before_wrap"] == [
        "regress.0.weight", "regress.0.bias", "regress.2.weight", "regress.2.bias"]
    assert cands["recommended"]["correct"] and cands["static_graph"]["correct"] and cands["find_unused"]["correct"]
    assert result["winner"]["name"] != "user"
    assert done.returncode == 0


def test_changing_graph_static_graph_is_incorrect(tmp_path: Path) -> None:
    # Which candidates the check rules out is tested without processes in tests/test_bench_candidates.py.
    _, result = bench(["--rounds", "1", "--configs", "user,recommended", str(EXAMPLES / "dynamic_graph.py"),
                       "--aux-every", "2"], tmp_path)
    cands = by_name(result)
    assert not cands["user"]["correct"] and cands["user"]["config"]["static_graph"] is True
    assert "static-graph-unsafe" in cands["user"]["reason"]
    assert cands["recommended"]["correct"] and cands["recommended"]["config"]["find_unused_parameters"]
    assert result["winner"]["name"] != "user"


def _render_in_chromium(page: Path, tmp_path: Path, names: list[str]) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("Chromium is not installed: `apt-get install chromium` (make test and .ci/run install it).")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,1600"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=False).stdout
    for name in names:
        assert f'data-candidate="{name}"' in dom, dom[:2000]
    assert "<svg" in dom and 'id="verdict"' in dom
    shot = tmp_path / "page.png"
    subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
    from PIL import Image

    pixels = Image.open(shot).convert("L")
    low, high = pixels.getextrema()
    assert high - low > 100, "the screenshot is blank"
    assert sum(1 for count in pixels.histogram() if count) > 20, "the screenshot has almost no content"


def test_a_crash_during_the_timed_steps_makes_the_candidate_incorrect(tmp_path: Path) -> None:
    from checkrun import SCRIPTS

    from ddp_doctor.bench.candidates import Config
    from ddp_doctor.bench.run import judge
    from ddp_doctor.cli.check import check

    with open(tmp_path / "log", "w") as log:
        result = check(str(SCRIPTS / "crash_late.py"), torchrun=["--nproc-per-node", "2"], steps=4, timed_steps=4,
                       timeout=120, output=log)
    assert result.report is not None and result.report.steps_observed == 4   # the observed steps were clean
    assert result.late_crash is not None and "loss is NaN at step 6" in result.late_crash
    correct, reason = judge(result, Config(), result.report, timed_steps=4)
    assert not correct and "crashed after the observed steps" in reason
