"""Ranks born warm (`launch/warm.py`): what the script sees, the start methods inside it, and a server that keeps
its hands off CUDA and thread pools.

Ground truth, plain torchrun (torch 2.13.0, 2 ranks, `torchrun --standalone --nproc-per-node 2
tests/scripts/warm_probe.py OUT --loaders`, exit code 0): the script runs as `__main__` with `sys.argv[0]` as given
on the command line, `__file__` absolute and `sys.path[0]` its folder; RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
and TORCHELASTIC_* are set, OMP_NUM_THREADS=1 (so one intra-op thread); `multiprocessing.current_process()` is
MainProcess with no parent and no start method chosen; each rank leads its own session; `random`, numpy and torch's
unseeded generators draw different numbers on the two ranks (torch 2.13 seeds its CPU generator from the OS at
import); `set_start_method("spawn")` works, and DataLoader workers started by fork, spawn and forkserver each hand
out the 16 squares (sum 1240).

The first warm version differed in three of these, each fixed and asserted here: the script's own
`set_start_method` failed ("context has already been set": the fork carried the launcher's start method), and both
ranks drew the same numbers from numpy and from torch's generator (both seeded once, in the server).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkrun import REPO, SCRIPTS, check
from frameworkrun import ran_to_end

PROBE = str(SCRIPTS / "warm_probe.py")
_SAME = (
    "name",
    "file",
    "cwd",
    "path0",
    "process",
    "parent_process",
    "start_method",
    "session_leader",
    "threads",
    "cuda_initialized",
    "start_method_set",
    "loader_sums",
)
_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS")
_ELASTIC = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE")


def _facts(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def _torch_import_threads() -> int:
    """Threads of a process that imported torch and nothing else (numpy's BLAS may start one), as in the server."""
    code = "import os, torch; print(len(os.listdir('/proc/self/task')))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout)


@pytest.mark.timeout(420)  # three launches and a torch import: past the default 120 s on a loaded machine
def test_the_script_sees_what_torchrun_gives_it_warm_or_fresh(tmp_path: Path) -> None:
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", PROBE]
        + [str(tmp_path / "plain"), "--loaders"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert ran_to_end(plain), plain.stderr[-3000:]  # torch 2.13's abort at exit aside
    args = ["--nproc-per-node", "2", "--steps", "4", PROBE]
    warm = check([*args, str(tmp_path / "warm"), "--loaders"], tmp_path / "w", timeout=180)
    fresh = check(["--fresh-interpreters", *args, str(tmp_path / "fresh"), "--loaders"], tmp_path / "f", timeout=180)
    assert warm.rc == fresh.rc == 0, warm.output + fresh.output
    assert warm.report["launch"] == "warm" and fresh.report["launch"] == "fresh"
    assert "Warning" not in warm.output and "Warning" not in fresh.output  # nothing of ours on stderr
    assert warm.report["steps_observed"] == fresh.report["steps_observed"] == 4

    runs = {"plain": _facts(tmp_path / "plain"), "warm": _facts(tmp_path / "warm"), "fresh": _facts(tmp_path / "fresh")}
    for rank in (0, 1):
        base = runs["plain"][rank]
        assert base["name"] == "__main__" and base["loader_sums"] == {
            "fork": 1240.0,
            "spawn": 1240.0,
            "forkserver": 1240.0,
        }
        for kind in ("warm", "fresh"):
            got = runs[kind][rank]
            assert {k: got[k] for k in _SAME} == {k: base[k] for k in _SAME}, kind
            # sys.argv[0]: the same file (runpy makes it absolute, where python keeps the command line's path).
            assert os.path.abspath(got["argv"][0]) == os.path.abspath(REPO / base["argv"][0]), kind
            assert got["argv"][2:] == base["argv"][2:] == ["--loaders"], kind
            assert {k: got["env"].get(k) for k in _ENV} == {k: base["env"].get(k) for k in _ENV}, kind
            assert all(k in got["env"] for k in _ELASTIC), kind
    # The two ranks draw their own numbers from every unseeded generator, as separate interpreters do.
    for kind, (r0, r1) in runs.items():
        assert r0["random"] != r1["random"] and r0["numpy"] != r1["numpy"], kind
        assert r0["torch_rand"] != r1["torch_rand"], kind
    # A warm rank's environment is the fresh one's, but for the variable that says how it was born.
    warm_env, fresh_env = set(runs["warm"][0]["env"]), set(runs["fresh"][0]["env"])
    assert warm_env - fresh_env == {"DDP_DOCTOR_LAUNCH"}, warm_env ^ fresh_env
    assert fresh_env - warm_env == {"DDP_DOCTOR_FRESH_INTERPRETERS"}, warm_env ^ fresh_env
    # The warm ranks' parent is the server, forked from torchrun's agent (the same command line, one level up), and
    # it runs no thread beyond those importing torch starts.
    for facts in runs["warm"]:
        assert "ddp_doctor.launch.torchrun" in facts["grandparent_cmdline"], facts["grandparent_cmdline"]
        assert facts["parent_cmdline"] == facts["grandparent_cmdline"]
        assert facts["parent_tasks"] <= _torch_import_threads()
    for facts in runs["fresh"]:
        assert "ddp_doctor.launch.torchrun" in facts["parent_cmdline"], facts["parent_cmdline"]


def test_the_servers_imports_never_call_into_cuda(tmp_path: Path) -> None:
    """What the launcher imports before it forks the server (torch) and what the server imports then
    (`warm.warm_imports`, for check's and bench's entry points), in a process where every torch.cuda entry point that
    could initialise CUDA counts its calls."""
    code = """
import json, os, torch, torch.cuda
calls = []
def counting(owner, name):
    original = getattr(owner, name, None)
    if original is None:
        return
    def wrapper(*a, **k):
        calls.append(name)
        return original(*a, **k)
    setattr(owner, name, wrapper)
for name in ("_lazy_init", "init", "is_available", "device_count", "current_device", "set_device", "get_device_name",
             "get_device_properties", "mem_get_info", "synchronize", "_cuda_getDeviceCount"):
    counting(torch.cuda, name)
for name in ("_cuda_init", "_cuda_getDeviceCount", "_cuda_getDevice", "_cuda_setDevice"):
    counting(torch._C, name)
import sys
import importlib, torch.distributed
from ddp_doctor.launch.warm import warm_imports
for name in warm_imports(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps({"calls": calls, "initialized": torch.cuda.is_initialized(),
                  "session": "ddp_doctor.launch.session" in sys.modules}))
"""
    for entry in ("ddp_doctor.launch.bootstrap", "ddp_doctor.bench.start"):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", code, entry], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        audit = json.loads(out.stdout.strip().splitlines()[-1])
        assert audit == {"calls": [], "initialized": False, "session": True}, (entry, audit)


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a GPU: a CUDA script under the warm launch"
)
def test_a_cuda_script_runs_under_the_warm_launch(tmp_path: Path) -> None:
    """Under a server that had initialised CUDA, a forked rank's first CUDA call fails ("Cannot re-initialize CUDA
    in forked subprocess"). Two ranks share the GPU over gloo."""
    run = check(["--nproc-per-node", "2", "--steps", "4", str(SCRIPTS / "gpu_input.py")], tmp_path, timeout=240)
    assert run.report is not None and run.report["launch"] == "warm", run.output
    assert run.report["steps_observed"] == 4 and "rank-crashed" not in run.codes, run.output
