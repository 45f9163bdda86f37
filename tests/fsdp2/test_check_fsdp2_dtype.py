"""A mixed-precision policy whose dtype meets float32 in the forward: FSDP2's error named in its words
(tests/scripts/fsdp2_uncast.py, `MixedPrecisionPolicy(param_dtype=torch.bfloat16)`, float32 batches).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks:
- every module sharded with the default policy (it casts the inputs): exit code 0;
- `cast_forward_inputs=False`: every rank fails at the first forward, "RuntimeError: mat1 and mat2 must have the
  same dtype, but got Float and BFloat16" (the float32 batch meets the first block's bfloat16 weights), exit code 1;
- the blocks sharded with the policy but not the root: every rank fails at the first forward, "... but got
  BFloat16 and Float" (the root's float32 head gets the last block's bfloat16 output), exit code 1.
Loud, so no finding: before, the check's error said "the script failed on rank 0 before it built a DDP model"
with torch's message, which names neither FSDP2 nor its policy.
"""

from __future__ import annotations

from pathlib import Path

from checkrun import SCRIPTS, check

from ddp_doctor.analyze import explain_fsdp2_crash

SCRIPT = str(SCRIPTS / "fsdp2_uncast.py")
SHARD = {"calls": 3, "site": "train.py:20", "policy": {"site": "train.py:20", "param_dtype": "bfloat16"}}


def _check(tmp_path: Path, *args: str):
    return check(["--nproc-per-node", "2", "--no-verify", SCRIPT, *args], tmp_path)


def test_inputs_the_policy_does_not_cast_are_explained_with_the_policy_and_its_line(tmp_path: Path) -> None:
    run = _check(tmp_path, "--no-cast")
    assert run.rc == 2 and run.report is not None and run.report["findings"] == [], run.output
    error = run.report["error"]
    assert error.startswith(
        "the script failed on rank 0 before its first optimizer step, in an FSDP2 job (3 fully_shard calls, the "
        "first at tests/scripts/fsdp2_uncast.py:22): the forward mixed float32 and bfloat16 tensors (RuntimeError: "
        "mat1 and mat2 must have the same dtype"
    ), error
    assert "cast_forward_inputs=False, so its float32 inputs reach bfloat16 weights uncast" in error
    assert "leave cast_forward_inputs at its default (True)" in error and "DDP" not in error


def test_a_float32_root_after_bfloat16_blocks_is_explained_with_the_fix(tmp_path: Path) -> None:
    run = _check(tmp_path, "--root-unsharded")
    assert run.rc == 2 and run.report is not None, run.output
    error = run.report["error"]
    assert "a module outside every fully_shard group keeps float32 weights" in error, error
    assert "fully_shard(model) on the root last" in error and "output_dtype=torch.float32" in error


def test_the_same_policy_on_every_module_casting_its_inputs_runs_clean(tmp_path: Path) -> None:
    run = _check(tmp_path)
    assert run.rc == 0 and run.report is not None and "error" not in run.report, run.output
    assert not run.errors() and not [f for f in run.report["findings"] if f["severity"] == "warning"], run.output


def test_another_error_in_an_fsdp2_job_keeps_torchs_words() -> None:
    text = explain_fsdp2_crash("ValueError", "bad batch", SHARD)
    assert text == "an FSDP2 job (3 fully_shard calls, the first at train.py:20): ValueError: bad batch"
    # A float16 policy's mismatch reads Half; a bfloat16 policy's message must name bfloat16.
    half = explain_fsdp2_crash(
        "RuntimeError",
        "expected scalar type Half but found Float",
        {**SHARD, "policy": {"site": "a.py:3", "param_dtype": "float16", "cast_forward_inputs": False}},
    )
    assert "mixed float32 and float16 tensors" in half and "`x.to(torch.float16)`" in half
    assert "mixed" not in explain_fsdp2_crash("RuntimeError", "expected scalar type Double but found Float", SHARD)
