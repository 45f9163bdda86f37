"""PyTorch's Flight Recorder dumps read by `ddp-doctor explain`: the first collective where the ranks parted, with
each side's ranks, op and the user's line; dumps it cannot read are named, never a traceback.

The entries below have the fields torch 2.13.0 writes (format version 2.10, from gloo and NCCL alike): checked
against a real dump in tests/watch/test_watch_hangs.py."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

from checkrun import REPO

from ddp_doctor.analyze.flight_recorder import first_divergence
from ddp_doctor.core.fr_dumps import read_dumps


def _entry(seq: int, op: str, size: int, line: int, *, group: str = "0") -> dict:
    return {
        "frames": [
            {
                "name": op,
                "filename": "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
                "line": 3245,
            },
            {"name": "main", "filename": "/job/train.py", "line": line},
        ],
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "process_group": (group, "default_pg"),
        "profiling_name": f"nccl:{op}",
        "input_sizes": [[size]] if size else [],
        "input_dtypes": ["Float"] if size else [],
        "state": "completed",
        "is_p2p": False,
    }


def _dump(folder: Path, rank: int, entries: list[dict], *, version: str = "2.10", ranks: str = "[0, 1]") -> None:
    data = {
        "version": version,
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
        "pg_status": {"0": {"last_enqueued_collective": len(entries), "last_completed_collective": len(entries) - 1}},
        "entries": entries,
    }
    (folder / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(data))


def test_the_first_collective_where_the_ranks_parted_is_named_with_both_sides(tmp_path: Path) -> None:
    common = [_entry(i, "all_reduce", 178, 40) for i in range(1, 5)]
    _dump(tmp_path, 0, [*common, _entry(5, "barrier", 0, 44)], ranks="[0, 1, 2]")
    _dump(tmp_path, 1, [*common, _entry(5, "all_reduce", 178, 40), _entry(6, "all_reduce", 178, 40)], ranks="[0, 1, 2]")
    dumps, problems = read_dumps(tmp_path)
    assert problems == [] and sorted(d.rank for d in dumps) == [0, 1]
    (finding,) = first_divergence(dumps)
    assert finding.code == "collective-mismatch" and finding.ranks == [0, 1]
    assert "#5" in finding.title and "barrier at /job/train.py:44" in finding.title
    assert "all_reduce(float[178]) at /job/train.py:40" in finding.title
    assert "rank 2 left no dump" in finding.detail


def test_a_rank_that_issued_fewer_collectives_is_the_side_that_issued_none(tmp_path: Path) -> None:
    common = [_entry(i, "all_reduce", 8, 12) for i in range(1, 4)]
    _dump(tmp_path, 0, [*common, _entry(4, "all_gather", 8, 30)])
    _dump(tmp_path, 1, common)
    (finding,) = first_divergence(read_dumps(tmp_path)[0])
    assert finding.ranks == [0, 1] and "rank 1 issued none (its last was #3)" in finding.detail


def test_agreeing_dumps_give_no_finding_and_the_ring_start_is_respected(tmp_path: Path) -> None:
    # rank 0's ring kept #3-#6, rank 1's #1-#6: only what both hold is compared
    _dump(tmp_path, 0, [_entry(i, "all_reduce", 8, 12) for i in range(3, 7)])
    _dump(tmp_path, 1, [_entry(i, "all_reduce", 8, 12) for i in range(1, 7)])
    assert first_divergence(read_dumps(tmp_path)[0]) == []


def test_dumps_it_cannot_read_are_named_and_explain_says_why_without_a_traceback(tmp_path: Path) -> None:
    _dump(tmp_path, 0, [_entry(1, "all_reduce", 8, 12)], version="3.0")
    (tmp_path / "notes.txt").write_text("not a dump")
    (tmp_path / "trace_rank_x").write_text(json.dumps({"version": "2.10", "entries": []}))
    dumps, problems = read_dumps(tmp_path)
    assert dumps == []
    assert any("format version 3.0" in p for p in problems) and any("no rank" in p for p in problems), problems
    done = subprocess.run(
        [sys.executable, "-m", "ddp_doctor.cli", "explain", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "format version 3.0" in done.stderr and "Traceback" not in done.stderr
