"""The CLI starts without torch and stops clean at any moment of its start; torchrun's options from the cache parse
exactly as torchrun's own parser parses them.

Ground truth before this (torch 2.13.0, this 2-core machine): `ddp-doctor --help` took 3.1 s, most of it importing
torch, and a SIGINT 1.5 s after `ddp-doctor check` started printed a KeyboardInterrupt traceback from inside torch's
import and exited -2 (3 of 3 tries). No test here times anything: they assert what is imported and what is printed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkrun import EXAMPLES, REPO, SCRIPTS, assert_no_leftovers

from ddp_doctor.cli import torchrun_options
from ddp_doctor.cli.torchrun_options import torchrun_actions, torchrun_parser


def _imports(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run the CLI with `-X importtime`; return the result and the top-level packages it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddp_doctor.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    names = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return done, names


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--help"], 0),
        (["codes"], 0),
        (["check", "--help"], 0),
        (["check", "--nproc-per-node", "2", "--steps", "0", str(EXAMPLES / "clean.py")], 2),
        (["check", "--nproc-per-node", "2", "no/such/train.py"], 2),
        (["check", "--nproc-per-node", "2", "--ddp-kwargs", "static_graph=True", str(EXAMPLES / "clean.py")], 2),
        (["bench", "--nproc-per-node", "2", "--rounds", "0", str(EXAMPLES / "clean.py")], 2),
        (["chekc"], 2),
        (["watch", "--help"], 0),
        (["watch", "--nproc-per-node", "2", "--hang-after", "-1", str(EXAMPLES / "clean.py")], 2),
        (["explain", "no/such/run"], 2),
    ],
)
def test_help_codes_and_argument_errors_never_import_torch(args: list[str], code: int) -> None:
    _imports("check", "--help")  # the cache of torchrun's options exists from here on
    done, imported = _imports(*args)
    assert done.returncode == code, done.stderr[-2000:]
    assert "torch" not in imported, sorted(imported)
    assert "Traceback" not in done.stderr


def test_the_options_cache_is_rebuilt_for_a_new_home_and_parses_as_torchrun(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    first, imported_first = _imports("check", "--help", env=env)
    second, imported_second = _imports("check", "--help", env=env)
    assert first.returncode == second.returncode == 0
    assert "torch" in imported_first and "torch" not in imported_second  # built once, from torch's own parser
    assert list(tmp_path.glob("ddp-doctor/torchrun-options-*.json")), list(tmp_path.rglob("*"))
    assert first.stdout == second.stdout  # the same help either way


@pytest.mark.parametrize(
    "argv",
    [
        ["train.py"],
        ["--nproc-per-node", "4", "--nnodes", "1:2", "--max-restarts", "3", "train.py", "--lr", "3e-4"],
        ["--nproc_per_node=2", "--standalone", "-m", "pkg.train", "--epochs", "1"],
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--monitor-interval", "0.5", "t.py"],
        ["--duplicate-stdout-filters", "a,b", "--start-method", "fork", "--redirects", "3", "t.py"],
    ],
)
@pytest.mark.parametrize("pet", [{}, {"PET_NPROC_PER_NODE": "3", "PET_STANDALONE": "1", "PET_MAX_RESTARTS": "2"}])
def test_the_cached_options_parse_like_torchruns_own(argv: list[str], pet: dict[str, str], monkeypatch) -> None:
    for key, value in pet.items():
        monkeypatch.setenv(key, value)
    ours = argparse.ArgumentParser(add_help=False)
    torchrun_actions(ours)
    mine, theirs = vars(ours.parse_args(argv)), vars(torchrun_parser().parse_args(argv))
    # A value of a type of torch's own stays a string in the CLI; the launcher converts it with torch's parser.
    assert mine.pop("duplicate_stdout_filters") in ("a,b", theirs.pop("duplicate_stdout_filters"))
    assert mine == theirs


class _TorchsOwn(argparse.Action):
    """An action that is torch's own code, as torch 2.15's `--print-completion` (prints a script and exits)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(0, "completion\n")


def test_options_of_every_action_kind_parse_like_torchruns_and_torchs_own_commands_are_named(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A newer torch adds options whose action the cache does not know (torch 2.15.0's `--print-completion`
    stopped every `check` with a ValueError): argparse's own actions parse as torch's parser parses them, and an
    option that runs torch's own code keeps its default and, when named, is an argument error naming it."""

    def newer_parser() -> argparse.ArgumentParser:
        parser = torchrun_parser()
        parser.add_argument("--print-shell", action=_TorchsOwn, choices=["bash", "zsh"])
        parser.add_argument("--quiet-count", action="count", default=0)
        parser.add_argument("--fast", action="store_const", const="yes", default="no")
        parser.add_argument("--tag", action="append")
        return parser

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torchrun_options, "torchrun_parser", newer_parser)
    ours = argparse.ArgumentParser(add_help=False)
    torchrun_actions(ours)
    argv = ["--quiet-count", "--quiet-count", "--fast", "--tag", "a", "--tag", "b", "t.py", "--lr", "1"]
    assert vars(ours.parse_args(argv)) == vars(newer_parser().parse_args(argv))
    assert vars(ours.parse_args(["t.py"]))["print_shell"] is None
    with pytest.raises(SystemExit) as exited:
        ours.parse_args(["--print-shell", "zsh", "t.py"])
    assert exited.value.code == 2
    assert "--print-shell" in capsys.readouterr().err


def _started_check() -> subprocess.Popen[str]:
    """A check of a script that trains for minutes (`slow.py`): a signal a few seconds in always finds it running.
    (A check of `clean.py` born warm can end within 3 s on a fast machine, and a signal then meets the launcher or
    the CLI at their exit.)"""
    env = {**os.environ, "DDP_DOCTOR_TEST_TAG": f"start-{time.monotonic_ns()}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddp_doctor.cli", "check", "--nproc-per-node", "2", str(SCRIPTS / "slow.py")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.tag = env["DDP_DOCTOR_TEST_TAG"]  # type: ignore[attr-defined]
    return proc


@pytest.mark.parametrize(
    ("sig", "delay"), [(signal.SIGINT, 0.3), (signal.SIGINT, 1.5), (signal.SIGTERM, 0.8), (signal.SIGINT, 3.0)]
)
def test_a_signal_while_the_cli_starts_exits_128_plus_it_with_one_line(sig: signal.Signals, delay: float) -> None:
    """Sent while the CLI parses, starts the launcher, or waits for the ranks to be born: every time the exit code
    is 128 + the signal, stderr is one line naming it, and no process of the run is left."""
    proc = _started_check()
    time.sleep(delay)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("ddp-doctor:")]
    assert len(ours) == 1 and f"interrupted by {sig.name}" in ours[0], lines
    assert_no_leftovers(proc.tag)  # type: ignore[attr-defined]


_IN_A_CALLBACK = """
import logging, os, signal, sys, time, weakref
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
from ddp_doctor.launch.torchrun import _stops_never_printed

log = logging.getLogger("torch.distributed.run")  # to torchrun.log in the launcher (`main`)
log.handlers[:] = [logging.FileHandler(sys.argv[1])]
log.propagate = False
_stops_never_printed(SignalException)
signal.signal(signal.SIGTERM, _terminate_process_handler)  # as torch's agent installs it


class Held:
    pass


def collected(_ref):
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100_000):  # the handler runs here, inside the collector's callback
        pass


held = Held()
ref = weakref.ref(held, collected)
try:
    del held
    time.sleep(10)  # where the agent waits
    print("never stopped")
except SignalException as exc:
    print("stopped by", exc.sigval.name)
"""


def test_a_stop_signal_inside_the_launchers_callback_is_not_printed_and_still_stops_it(tmp_path: Path) -> None:
    """torch's agent turns SIGTERM into `SignalException` wherever the launcher's main thread is. Inside a garbage
    collector's callback Python printed it ("Exception ignored in ...", a traceback in the user's terminal, seen in
    CI under Ctrl-C) and the signal was lost. The launcher swallows it there and sends the signal again, which
    stops it where it waits."""
    log = tmp_path / "torchrun.log"
    done = subprocess.run([sys.executable, "-c", _IN_A_CALLBACK, str(log)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped by SIGTERM", done.stdout
    assert done.stderr == "", done.stderr
    assert "SIGTERM arrived inside a callback" in log.read_text()


def test_a_clean_check_reads_and_draws_its_report_without_importing_torch(tmp_path: Path) -> None:
    """torch is imported by the launcher and the ranks; the `ddp-doctor` process itself reads the ranks' joint
    report and draws it without it (its analysis of a failed run is what imports torch)."""
    done, imported = _imports(
        "check", "--nproc-per-node", "2", "--json", str(tmp_path / "r.json"), str(EXAMPLES / "clean.py")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch" not in imported, sorted(imported)
    assert "No problems found in what was compared" in done.stdout
