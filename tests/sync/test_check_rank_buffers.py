"""A DDP model's buffer that differs across ranks (tests/scripts/rank_buffers.py, 2 ranks, 8 steps), whether it was
made before the wrap, reassigned after it, or registered after it.

Ground truth under plain torchrun (torch 2.13.0, gloo; each rank prints its model's output on one input, `probe`):
- drawn-per-rank (`scale` drawn from each rank's seed in the constructor), broadcast_buffers=False: exit 0, the
  weights equal on both ranks, the probes -0.555 and -1.064. DDP built with broadcast_buffers=False skips its
  broadcast of rank 0's buffers at construction too (torch's `_sync_module_states(..., broadcast_buffers=...)`).
  With broadcast_buffers=True (the fix): both probes -0.560.
- reassigned (`model.module.scale = ...` from each rank's seed after the wrap): probes -1.192 and -1.561; DDP's
  list of buffers made at wrap time still held the old tensor, which the check compared: "No problems found".
- registered (`register_buffer("shift", ...)` after the wrap): probes -0.397 and -0.763; "No problems found".
- with broadcast_buffers=True the reassigned and registered buffers are broadcast before each forward: the probes
  agree. same-seed: the probes agree. batchnorm (running statistics, broadcast_buffers=False): -0.484 and -0.495.
Before, the first case was a warning about running statistics ("Evaluation then differs by rank"), and the other two
said nothing.
- bufferless (no buffer when DDP is built, `shift` registered per rank after it), even with broadcast_buffers=True:
  probes -0.946 and -1.307, weights equal, exit 0. DDP syncs buffers only when its list of buffers made at
  construction is not empty (`will_sync_module_buffers`); with one buffer at the wrap, the late `shift` is broadcast
  (probes equal). The check said "No problems found" and listed no buffer among what it compared.
- opaque (as bufferless, `shift` in a tensor subclass supporting only its own `dequantize()`, as a quantized
  weight's, and a frozen parameter of that subclass attached after the wrap): the same probes; the check cannot
  read them and lists both as not compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkrun import REPO, SCRIPTS, check
from frameworkrun import torchrun

from ddp_doctor.core.compat import HAS_FORWARD_SYNC_BUFFERS

SCRIPT = str(SCRIPTS / "rank_buffers.py")


def _check(tmp_path: Path, case: str, *flags: str):
    return check(["--nproc-per-node", "2", SCRIPT, str(tmp_path / "out"), "--case", case, *flags], tmp_path)


def _probes(tmp_path: Path, case: str, *flags: str) -> list[float]:
    out = tmp_path / "plain"
    done = torchrun("rank_buffers.py", [str(out), "--case", case, *flags], REPO, timeout=120)
    assert done.rc == 0 or done.aborted_at_exit, done.output[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text())["probe"] for r in (0, 1)]


def test_a_buffer_drawn_per_rank_without_broadcast_is_an_error_and_the_fix_makes_the_replicas_agree(
    tmp_path: Path,
) -> None:
    apart = _probes(tmp_path / "apart", "drawn-per-rank")
    assert abs(apart[0] - apart[1]) > 0.1, apart
    run = _check(tmp_path / "check", "drawn-per-rank")
    found = run.finding("buffer-divergence")
    assert found["severity"] == "error" and run.params("buffer-divergence") == {"scale"}, run.output
    assert found["ranks"] == [0, 1] and found["steps"] == list(range(8)), found
    assert "broadcast_buffers=True" in found["fix"], found
    assert run.rc == 1
    if HAS_FORWARD_SYNC_BUFFERS:  # torch's deprecation warning points at the script's line, as without the doctor
        lines = (SCRIPTS / "rank_buffers.py").read_text().splitlines()
        at = next(i for i, text in enumerate(lines, 1) if "DistributedDataParallel(net" in text)
        assert f"rank_buffers.py:{at}: FutureWarning" in run.output and "patches.py" not in run.output, run.output
    fixed = _probes(tmp_path / "fixed", "drawn-per-rank", "--broadcast-buffers")
    assert fixed[0] == pytest.approx(fixed[1], abs=1e-6), fixed
    assert _check(tmp_path / "check-fixed", "drawn-per-rank", "--broadcast-buffers").codes == set()


@pytest.mark.parametrize(
    "case, name, line", [("reassigned", "scale", None), ("registered", "shift", 'register_buffer("shift", torch.rand')]
)
def test_a_buffer_set_per_rank_after_the_wrap_is_an_error(tmp_path: Path, case: str, name: str, line: str) -> None:
    run = _check(tmp_path, case)
    found = run.finding("buffer-divergence")
    assert found["severity"] == "error" and run.params("buffer-divergence") == {name}, run.output
    assert found["ranks"] == [0, 1] and found["steps"][0] == 0, found
    if line is not None:
        lines = (SCRIPTS / "rank_buffers.py").read_text().splitlines()
        at = f"rank_buffers.py:{next(i for i, text in enumerate(lines, 1) if line in text)}"
        assert any(site.endswith(at) for site in found["sites"]), found
    assert run.report["compared"]["buffers_after_wrap"] == (1 if case == "registered" else 0), run.report["compared"]
    assert run.rc == 1


@pytest.mark.parametrize("case, flags", [("same-seed", ()), ("registered", ("--broadcast-buffers",))])
def test_buffers_equal_on_every_rank_stay_clean(tmp_path: Path, case: str, flags: tuple[str, ...]) -> None:
    run = _check(tmp_path, case, *flags)
    assert run.rc == 0 and run.codes == set(), run.output


def test_running_statistics_without_broadcast_stay_a_warning(tmp_path: Path) -> None:
    run = _check(tmp_path, "batchnorm")
    found = run.finding("buffer-divergence")
    assert found["severity"] == "warning", found
    assert run.params("buffer-divergence") == {"norm.running_mean", "norm.running_var"}, run.output


def test_a_buffer_registered_after_wrapping_a_model_without_buffers_is_never_broadcast(tmp_path: Path) -> None:
    apart = _probes(tmp_path / "apart", "bufferless", "--broadcast-buffers")
    assert abs(apart[0] - apart[1]) > 0.1, apart
    run = _check(tmp_path / "check", "bufferless", "--broadcast-buffers")
    found = run.finding("buffer-divergence")
    assert found["severity"] == "error" and run.params("buffer-divergence") == {"shift"}, run.output
    assert found["ranks"] == [0, 1], found
    lines = (SCRIPTS / "rank_buffers.py").read_text().splitlines()
    at = next(i for i, text in enumerate(lines, 1) if 'in ("registered", "bufferless")' in text) + 1
    assert any(site.endswith(f"rank_buffers.py:{at}") for site in found["sites"]), found
    assert "broadcast_buffers=True" not in found["fix"], found  # it is on already: the fix is where it is registered
    assert run.report["compared"]["buffers"] == 0 and run.report["compared"]["buffers_after_wrap"] == 1
    assert run.rc == 1


def test_a_buffer_ddp_holds_that_the_check_cannot_read_is_listed_as_not_compared(tmp_path: Path) -> None:
    """opaque-at-wrap: plain torchrun exit 0, the probes -0.397 and -0.763 (the buffer is each rank's own); the
    report said "No problems found" and named nothing."""
    run = _check(tmp_path, "opaque-at-wrap")
    assert run.codes == set(), run.output
    compared = run.report["compared"]  # scale read, shift not
    assert compared["buffers"] == 1 and compared["buffers_not_recorded"] == 1, compared
    assert [line for line in run.report["unchecked"] if "buffer shift" in line], run.report["unchecked"]


def test_a_buffer_the_check_cannot_read_is_listed_as_not_compared(tmp_path: Path) -> None:
    run = _check(tmp_path, "opaque", "--broadcast-buffers")
    assert run.codes == set(), run.output
    compared = run.report["compared"]
    assert compared["unreadable"] == 2 and compared["buffers_after_wrap"] == 0, compared
    named = [line for line in run.report["unchecked"] if "buffer shift (Opaque)" in line]
    assert named and "parameter codebook (Opaque)" in named[0], run.report["unchecked"]
