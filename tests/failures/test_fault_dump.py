"""Python's faulthandler dump, as a rank leaves it when a signal kills it (`core/rankstate.Fault.parse`)."""

from __future__ import annotations

from ddp_doctor.core.rankstate import Fault

# A rank aborted by gloo (torch 2.13.0, CPU; `faulthandler.enable(all_threads=True)`): the abort comes from a
# thread of gloo's with no Python frame, so no thread is "Current thread"; the watchdog's thread and the main one
# are listed.
GLOO_ABORT = """Fatal Python error: Aborted

Thread 0x00007f1d4e7fc6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 629 in wait
  File "/work/src/ddp_doctor/launch/watchdog.py", line 71 in _run
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007fe2c3c64b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4394 in all_gather_single
  File "/work/train.py", line 83 in <module>

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""

SEGV_IN_MAIN = """Fatal Python error: Segmentation fault

Thread 0x00007f1d4e7fc6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007fe2c3c64b80 (most recent call first):
  File "/work/segv.py", line 15 in <module>
"""


def test_an_abort_from_a_native_thread_gives_the_main_threads_stack_not_the_watchdogs() -> None:
    fault = Fault.parse(GLOO_ABORT)
    assert fault is not None and fault.signal == "SIGABRT"
    assert fault.frames[0][2] == "all_gather_single" and fault.frames[1] == ("/work/train.py", 83, "<module>")


def test_the_thread_that_hit_the_signal_comes_first_when_it_ran_python() -> None:
    fault = Fault.parse(SEGV_IN_MAIN)
    assert fault is not None and fault.signal == "SIGSEGV" and fault.frames == [("/work/segv.py", 15, "<module>")]
    assert Fault.parse("no dump here") is None
