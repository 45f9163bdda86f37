"""examples/clean.py, with the moment its first line runs written down first: for benchmarks/check_overhead.py.

Each rank writes `rank{RANK}.json` into `$FIRST_LINE_DIR`: the wall-clock time of its first line, of its process's
birth (from /proc: the fork of a warm rank, the exec of a fresh one), and of the command's start (`$LAUNCHED_AT`).
Then it runs examples/clean.py as `__main__`, with this script's arguments.
"""

import json
import os
import sys
import time

first_line = time.time()


def _born() -> float:
    """When this process was made, in wall-clock seconds: its age from /proc (10 ms resolution) before now."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


if os.environ.get("FIRST_LINE_DIR"):
    with open(os.path.join(os.environ["FIRST_LINE_DIR"], f"rank{os.environ['RANK']}.json"), "w") as out:
        json.dump({"first_line": first_line, "born": _born(), "launched": float(os.environ["LAUNCHED_AT"])}, out)

if __name__ == "__main__":
    import runpy

    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
    sys.path.insert(0, os.path.abspath(examples))
    sys.argv[0] = os.path.join(examples, "clean.py")
    runpy.run_path(os.path.join(examples, "clean.py"), run_name="__main__")
