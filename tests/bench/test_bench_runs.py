"""`ddp-doctor bench` on the examples, as a subprocess: the correctness verdicts (never the timings), which blocks
shared a launch and why a new one started, the JSON contract, and the HTML page rendered by headless Chromium."""

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
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp_doctor.cli",
            "bench",
            "--nproc-per-node",
            "2",
            "--steps",
            "4",
            "--json",
            str(out),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert out.exists(), done.stdout + done.stderr
    return done, json.loads(out.read_text())


def by_name(result: dict) -> dict[str, dict]:
    return {c["name"]: c for c in result["candidates"]}


def test_find_unused_unneeded_recommended_config_is_correct_and_page_renders(tmp_path: Path) -> None:
    page = tmp_path / "bench.html"
    done, result = bench(
        [
            "--rounds",
            "2",
            "--configs",
            "user,recommended",
            "--html",
            str(page),
            str(EXAMPLES / "find_unused_all_used.py"),
        ],
        tmp_path,
    )
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
    # The example's loop has 16 steps: the check, user's block and recommended's fill the first launch; round 2
    # needs a second one, and the output says why.
    launches = result["launches"]
    assert [launch["blocks"] for launch in launches] == [
        ["user (round 1)", "recommended (round 1)"],
        ["recommended (round 2)", "user (round 2)"],
    ]
    assert "the script's loop ended after 16 optimizer steps in launch 1" in launches[1]["why"]
    assert all(launch["startup_s"] > 0 for launch in launches)
    assert "paid 2 time(s) for 4 block(s)" in " ".join(done.stdout.split())
    _render_in_chromium(page, tmp_path, names=list(cands))


def test_unused_head_default_flags_are_incorrect_and_the_fixes_are_correct(tmp_path: Path) -> None:
    done, result = bench(
        ["--rounds", "1", "--configs", "user,recommended,static_graph,find_unused", str(EXAMPLES / "unused_head.py")],
        tmp_path,
    )
    cands = by_name(result)
    assert set(cands) == {"user", "recommended", "static_graph", "find_unused"}
    assert not cands["user"]["correct"] and "reduction-error" in cands["user"]["reason"]
    assert cands["user"]["median_step_s"] is None
    assert cands["recommended"]["config"]["freeze_before_wrap"] == [
        "regress.0.weight",
        "regress.0.bias",
        "regress.2.weight",
        "regress.2.bias",
    ]
    assert cands["recommended"]["correct"] and cands["static_graph"]["correct"] and cands["find_unused"]["correct"]
    assert result["winner"]["name"] != "user"
    assert done.returncode == 0
    # The check's own run (the script's flags) is user's block: it crashed, so the others start a second launch,
    # built with recommended's flags and its frozen head, then rebuilt in place for find_unused. The example's
    # 16 steps hold two blocks of 4 + 4 steps: static_graph needs a third launch.
    first, second, third = result["launches"]
    assert first["blocks"] == ["user (round 1)"] and "reduction-error" in first["ended"]
    assert "the check ended launch 1" in second["why"]
    assert second["blocks"] == ["recommended (round 1)", "find_unused (round 1)"]
    assert third["blocks"] == ["static_graph (round 1)"] and "the script's loop ended" in third["why"]


def test_changing_graph_static_graph_is_incorrect(tmp_path: Path) -> None:
    # Which candidates the check rules out is tested without processes in tests/bench/test_candidates.py.
    _, result = bench(
        ["--rounds", "1", "--configs", "user,recommended", str(EXAMPLES / "dynamic_graph.py"), "--aux-every", "2"],
        tmp_path,
    )
    cands = by_name(result)
    assert not cands["user"]["correct"] and cands["user"]["config"]["static_graph"] is True
    assert "static-graph-unsafe" in cands["user"]["reason"]
    assert cands["recommended"]["correct"] and cands["recommended"]["config"]["find_unused_parameters"]
    assert result["winner"]["name"] != "user"


def test_candidates_share_one_launch_on_a_slow_start_script(tmp_path: Path) -> None:
    script = REPO / "benchmarks" / "scripts" / "slow_start.py"
    done, result = bench(
        [
            "--rounds",
            "3",
            "--configs",
            "user,recommended,static_graph,recommended+bucket_view",
            str(script),
            "--startup-s",
            "2",
            "--max-steps",
            "400",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    cands = by_name(result)
    assert all(c["correct"] for c in cands.values()), cands
    assert all(len(c["rounds"]) == 3 and all(len(r) == 4 for r in c["rounds"]) for c in cands.values())
    # One launch: the script slept through its start-up once, for the check and all twelve blocks.
    (launch,) = result["launches"]
    assert len(launch["blocks"]) == 12 and launch["blocks"][:4] == [
        "user (round 1)",
        "recommended (round 1)",
        "static_graph (round 1)",
        "recommended+bucket_view (round 1)",
    ]
    assert launch["startup_s"] >= 2.0 and result["startup_s"] == launch["startup_s"]
    assert result["rounds_run"] == 3 and result["winner"]["reference"] == "recommended"
    assert "paid 1 time(s) for 12 block(s)" in " ".join(done.stdout.split())


def test_a_candidate_that_crashes_mid_launch_is_incorrect_and_the_rest_go_on_in_a_new_launch(tmp_path: Path) -> None:
    from checkrun import SCRIPTS

    # Its auxiliary loss stops at step 10: the check (4 steps) sees every parameter used, user's second block
    # runs past step 10 in the shared launch and crashes with the reduction error.
    done, result = bench(
        ["--rounds", "3", "--configs", "user,static_graph,find_unused", str(SCRIPTS / "aux_off_later.py")], tmp_path
    )
    cands = by_name(result)
    assert not cands["user"]["correct"] and "crashed during its block" in cands["user"]["reason"]
    assert "Expected to have finished reduction" in cands["user"]["reason"]
    assert not cands["static_graph"]["correct"] and "used set differs" in cands["static_graph"]["reason"]
    assert cands["find_unused"]["correct"] and len(cands["find_unused"]["rounds"]) == 3
    # find_unused's second block runs past step 10 too: it sees the head unused and stays correct (it handles any
    # used set); static_graph saw the same in its first block and is held to the check's used set.
    first, second = result["launches"]
    assert first["blocks"][-2:] == ["find_unused (round 2)", "user (round 2)"]
    assert second["why"].startswith("user crashed in launch 1")
    assert result["winner"]["name"] == "find_unused" and done.returncode == 0


def test_a_script_with_two_ddp_models_runs_each_block_in_its_own_launch(tmp_path: Path) -> None:
    from checkrun import SCRIPTS

    # The GAN's critic fails with the script's flags (the check's run is user's block, judged over both models);
    # static_graph works, and with two DDP models it cannot be rebuilt in place: one launch per block, and why.
    done, result = bench(
        ["--steps", "3", "--rounds", "3", "--configs", "user,static_graph", str(SCRIPTS / "gan.py")], tmp_path
    )
    cands = by_name(result)
    assert not cands["user"]["correct"] and "reduction-error" in cands["user"]["reason"]
    assert cands["static_graph"]["correct"] and len(cands["static_graph"]["rounds"]) == 3
    first, second, *rest = result["launches"]
    assert first["blocks"] == ["user (round 1)"] and second["blocks"] == ["static_graph (round 1)"]
    assert [launch["blocks"] for launch in rest] == [["static_graph (round 2)"], ["static_graph (round 3)"]]
    assert all("builds 2 DDP models" in launch["why"] for launch in rest)
    assert result["winner"]["name"] == "static_graph" and done.returncode == 0


@pytest.mark.parametrize(
    ("script", "framework"), [("bench_accelerate.py", "accelerate"), ("bench_lightning.py", "lightning")]
)
def test_candidates_share_one_launch_when_a_framework_holds_the_ddp_model(
    tmp_path: Path, script: str, framework: str
) -> None:
    from checkrun import SCRIPTS

    done, result = bench(
        ["--rounds", "2", "--configs", "user,recommended,static_graph", str(SCRIPTS / script)], tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["check"]["framework"] == framework
    cands = by_name(result)
    assert all(c["correct"] and len(c["rounds"]) == 2 for c in cands.values()), cands
    (launch,) = result["launches"]
    assert len(launch["blocks"]) == 6 and launch["ended"] == "the maximum of 2"
    assert result["winner"]["name"] == "recommended"  # two rounds never show a winner: the least work


def _render_in_chromium(page: Path, tmp_path: Path, names: list[str]) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("Chromium is not installed: `apt-get install chromium` (make test and .ci/run install it).")
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,1600"]
    dom = subprocess.run(
        [*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=False
    ).stdout
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
    from torch.distributed.run import get_args_parser

    from ddp_doctor.bench.candidates import Config
    from ddp_doctor.bench.launched import time_steps
    from ddp_doctor.bench.run import judge

    namespace = vars(get_args_parser().parse_args(["--nproc-per-node", "2", str(SCRIPTS / "crash_late.py")]))
    with open(tmp_path / "log", "w") as log:
        result = time_steps(namespace, steps=4, timed_steps=4, timeout=120, output=log)
    report = result.check.report
    assert report is not None and report.steps_observed == 4  # the observed steps were clean
    assert result.late_crash is not None and "loss is NaN at step 6" in result.late_crash
    correct, reason = judge(result, Config(), report, timed_steps=4)
    assert not correct and "crashed after the observed steps" in reason
