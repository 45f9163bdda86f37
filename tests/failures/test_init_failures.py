"""A rank that never joins the process group: `check` names it, not the rank that waited for it.

Ground truth under plain torchrun (torch 2.13.0, gloo, this 2-core machine), tests/scripts/init_wrong_port.py (rank 1
alone given a wrong MASTER_PORT, the group's timeout 10 s): rank 1 retries its connection to the store; rank 0 raises
*DistStoreError: wait timeout after 10000ms, keys: /default_pg/0//cpu//0/1* from `init_process_group` after 10 s;
torchrun sends SIGTERM to rank 1 and exits 1 after 13.4 s, its summary naming rank 0 (exit code 1) as the root
cause and rank 1 as ended by SIGTERM.
"""

from __future__ import annotations

from checkrun import SCRIPTS, check, line_of


def test_a_rank_that_never_joins_the_process_group_is_named_with_where_it_was(tmp_path) -> None:
    script = SCRIPTS / "init_wrong_port.py"
    run = check(["--nproc-per-node", "2", "--timeout", "90", str(script)], tmp_path)
    assert run.rc == 2 and run.report is not None and run.report["findings"] == [], run.output
    said = run.report["error"]
    init = f"init_wrong_port.py:{line_of(script, 'dist.init_process_group(')}"
    # rank 1 is the one named, at the line of its own init_process_group; rank 0 only timed out waiting for it
    assert "waiting for rank 1 to join" in said and "rank 1 was at step 0, before DDP was built, at" in said, said
    assert said.count(init) == 2 and "Traceback" not in said, said
    assert said in run.output.replace("\n", " ") or said[:200] in run.output, run.output
