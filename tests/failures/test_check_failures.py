"""`ddp-doctor check` when the script goes wrong in ways that depend on DDP and torch: a crash on one rank, DDP's
own errors, evaluation through the wrapper, a rank-dependent model, early ends, two nodes, and user code that
copies and pickles the observed model. Every run must end, name the rank, and exit with the documented code. (CI
runs this file on both torch corners; the command line's own errors are `test_check_cli.py`, hangs and signals
`test_faults.py`.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from checkrun import EXAMPLES, SCRIPTS, check, finish, free_port, start

# A run whose observed steps end early (a crash, a short script) makes a second run to verify its recommendation.
pytestmark = pytest.mark.timeout(300)


def test_crash_on_rank_1_names_the_rank_step_and_error(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", "--timeout", "60", str(SCRIPTS / "crash_rank1.py")], tmp_path)
    assert run.rc == 1, run.output
    assert run.codes == {"rank-crashed"}, run.output
    finding = run.finding("rank-crashed")
    assert finding["ranks"] == [1] and finding["steps"] == [3], finding
    assert finding["labels"] == {
        "kind": "raised",
        "exception": "ValueError",
        "message": "corrupt sample 1234 in shard 1",
    }, finding
    assert finding["measured"] == [{"name": "other_ranks", "value": 1, "unit": "count"}], finding
    assert [p["rank"] for p in finding["positions"]] == [1, 0], finding
    assert [site.rsplit("/", 1)[-1] for site in finding["sites"]] == ["crash_rank1.py:10"], finding
    # Where rank 0 was: it either noticed the lost peer first or was stopped while still waiting in DDP's
    # all-reduce (which comes first depends on the machine's load); both name its step.
    assert (
        "rank 0 lost its peer at step 3" in finding["detail"] or "rank 0 was at step 3, backward" in finding["detail"]
    ), finding["detail"]
    assert "corrupt sample 1234" in run.output  # the traceback reaches the user
    # Nothing observed supports any flags: the JSON says so with nulls, never with the script's own flags.
    rec = run.report["recommendation"]
    assert [rec[k] for k in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")] == [None] * 3, rec
    assert rec["verified"] is False and rec["flags_known"] is False and rec["render"] == {}, rec


def test_isinstance_copy_and_pickle_keep_working_while_observed(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "introspect.py")], tmp_path)
    assert run.rc == 0 and run.codes == set(), run.output
    assert run.report["steps_observed"] == 8


def test_two_nodes_of_one_process_give_the_same_report_as_one_node_of_two(tmp_path: Path) -> None:
    script = str(EXAMPLES / "unused_head.py")
    # A multi-node check runs no verification run (each node would have to start it in step with the others), so
    # the one-node run is compared without it too.
    single = check(["--nproc-per-node", "2", "--no-verify", script], tmp_path / "single")
    port = free_port()
    rdzv = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"test-{port}",
        "--timeout",
        "90",
    ]
    started = time.monotonic()
    nodes = [start([*rdzv, "--node-rank", str(n), script], tmp_path, name=f"node{n}.json") for n in (0, 1)]
    runs = [finish(proc, out, timeout=120, started=started) for proc, out in nodes]

    def essence(report: dict) -> str:
        keep = ("world_size", "steps_observed", "ddp_config", "findings", "crashes")
        rec = {k: v for k, v in report["recommendation"].items()}
        return json.dumps({**{k: report[k] for k in keep}, "recommendation": rec}, sort_keys=True)

    for run in runs:
        assert run.rc == single.rc == 1, run.output
        assert run.report["world_size"] == 2
        assert run.report["launch"] == single.report["launch"] == "warm"  # each node's ranks born from its server
        assert essence(run.report) == essence(single.report), run.output


def test_a_rank_0_evaluation_through_ddp_in_grad_mode_is_named_and_the_right_way_is_clean(tmp_path: Path) -> None:
    wrong = check(["--nproc-per-node", "2", str(SCRIPTS / "eval_rank0.py"), "--grad"], tmp_path / "grad")
    mismatch = wrong.finding("collective-mismatch")
    assert mismatch["ranks"] == [0] and mismatch["steps"] == [2, 5], mismatch
    assert "tests/scripts/eval_rank0.py:24" in mismatch["sites"], mismatch
    # it survived: a forward in grad mode with no backward, and no buffers to broadcast
    assert mismatch["severity"] == "warning" and mismatch["labels"]["kind"] == "forward-without-backward", mismatch
    right = check(["--nproc-per-node", "2", str(SCRIPTS / "eval_rank0.py")], tmp_path / "no_grad")
    assert right.rc == 0 and right.codes == set(), right.output


def test_a_rank_0_evaluation_through_ddp_under_no_grad_with_batchnorm_is_named_and_the_right_way_is_clean(
    tmp_path: Path,
) -> None:
    wrong = check(["--nproc-per-node", "2", str(SCRIPTS / "eval_rank0_bn.py")], tmp_path / "ddp")
    mismatch = wrong.finding("collective-mismatch")
    assert mismatch["severity"] == "error" and mismatch["ranks"] == [0] and mismatch["steps"] == [2, 5], mismatch
    assert "tests/scripts/eval_rank0_bn.py:30" in mismatch["sites"], mismatch
    assert mismatch["labels"]["kind"] == "broadcast-without-grad", mismatch
    assert "ddp_model.module(x)" in mismatch["fix"], mismatch
    assert wrong.rc == 1, wrong.output
    right = check(["--nproc-per-node", "2", str(SCRIPTS / "eval_rank0_bn.py"), "--module"], tmp_path / "module")
    assert right.rc == 0 and right.codes == {"batchnorm-not-synced"}, right.output


def test_a_head_only_rank_0_trains_is_rank_dependent_after_a_one_step_crash(tmp_path: Path) -> None:
    """Default flags, a head used on rank 0 only: rank 1 fails at step 1 with DDP's reduction error while rank 0
    waits for it. The report says the graph depends on the rank (rank 0's beacon: it closed step 0 with every
    gradient), and no fix tells the user to freeze the head rank 0 trains."""
    run = check(["--nproc-per-node", "2", "--timeout", "60", str(SCRIPTS / "rank0_head.py")], tmp_path, timeout=240)
    assert run.rc == 1, run.output
    rank_dependent = run.finding("rank-dependent-graph")
    assert run.params("rank-dependent-graph") == {"aux.weight", "aux.bias"}
    assert rank_dependent["ranks"] == [0, 1] and rank_dependent["steps"] == [0], rank_dependent
    assert "static_graph=True" in rank_dependent["fix"] and "keep them trainable" in rank_dependent["fix"]
    assert all("requires_grad=False" not in f["fix"] + f["detail"] for f in run.report["findings"]), run.output
    rec = run.report["recommendation"]
    assert rec["freeze_before_wrap"] == [] and rec["verified"] is True, rec  # by check's own second run
    # One step is all DDP allowed: the flag that works whether or not each rank's set changes, never the defaults.
    assert rec["find_unused_parameters"] is True and rec["static_graph"] is False, rec

    # Applied, it works: every step synced, the head still trained on rank 0, and the next advice is the cheaper one.
    kwargs = {k: rec[k] for k in ("find_unused_parameters", "static_graph")}
    again = check(
        ["--nproc-per-node", "2", "--ddp-kwargs", json.dumps(kwargs), str(SCRIPTS / "rank0_head.py")], tmp_path / "fix"
    )
    assert again.rc == 0 and again.errors() == [], again.output
    assert again.report["steps_observed"] == 8, again.output
    assert again.params("rank-dependent-graph") == {"aux.weight", "aux.bias"}, again.output
    assert again.finding("rank-dependent-graph")["severity"] == "info", again.output
    assert again.report["recommendation"]["static_graph"] is True, again.report["recommendation"]
    assert again.report["recommendation"]["freeze_before_wrap"] == []


def test_destroy_process_group_with_none_before_the_steps_reports_on_the_steps_it_ran(tmp_path: Path) -> None:
    """`dist.destroy_process_group(None)` (Accelerate's end_training()) after 3 of 8 steps ends the run like the
    no-argument form: a find_unused_parameters=True model that uses every parameter gets find-unused-unneeded.

    Ground truth (plain torchrun, 2 ranks): both ranks train 3 steps and exit 0. The fix, find_unused_parameters=
    False, is verified by check's second run on the same 3 steps (issue #32 item 6: it read "not yet verified")."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "destroy_none.py")], tmp_path, timeout=240)
    assert run.rc == 0, run.output
    assert run.codes == {"find-unused-unneeded"}, run.output
    assert run.report["steps_observed"] == 3, run.report
    rec = run.report["recommendation"]
    assert rec["find_unused_parameters"] is False and rec["static_graph"] is False, rec
    assert rec["verified"] is True and rec["verification"]["outcome"] == "verified", rec
    assert rec["verification"]["steps_observed"] >= rec["verification"]["steps_needed"] == 3, rec
    assert "Fix the failure above" not in run.output, run.output


def test_static_graph_on_a_changing_graph_is_one_joint_finding_and_the_fix_is_verified(tmp_path: Path) -> None:
    """static_graph=True, an auxiliary head on even steps only (`tests/scripts/static_graph_changes.py`).

    Ground truth (plain torchrun, 2 ranks, torch 2.13.0+cpu): both ranks fail in the forward of step 2 (the third)
    with `RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one. This
    error indicates that your training graph has changed in this iteration ... this is not compatible with
    static_graph set to True.` ("Parameter indices which did not receive grad for rank R: 4 5", aux.weight and
    aux.bias); torchrun exits 1. With static_graph=False and find_unused_parameters=True all 20 steps run (exit 0).
    """
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "static_graph_changes.py")], tmp_path, timeout=240)
    assert run.rc == 1, run.output
    unsafe = [f for f in run.report["findings"] if f["code"] == "static-graph-unsafe"]
    assert len(unsafe) == 1 and unsafe[0]["ranks"] == [0, 1] and unsafe[0]["steps"] == [2], run.output
    assert {p["name"] for p in unsafe[0]["params"]} == {"aux.weight", "aux.bias"}, unsafe
    rec = run.report["recommendation"]
    assert rec["find_unused_parameters"] is True and rec["static_graph"] is False, rec
    assert rec["verified"] is True and rec["verification"]["outcome"] == "verified", rec


def test_a_parameter_used_outside_forward_is_one_joint_finding_and_the_fix_is_verified(tmp_path: Path) -> None:
    """find_unused_parameters=True, the loss calls `ddp.module.head(...)` on DDP's output
    (`tests/scripts/head_outside_forward.py`).

    Ground truth (plain torchrun, 2 ranks, torch 2.13.0+cpu): both ranks fail in the backward of step 0 with
    `RuntimeError: Expected to mark a variable ready only once. ... Parameter at index 3 with name head.bias has been
    marked as ready twice.`; torchrun exits 1. With static_graph=True and find_unused_parameters=False all 20 steps
    run (exit 0); default flags (both False) also run.

    Since a2719d7 both crashed ranks took each other for a rank waiting in DDP's all-reduce and left without
    exchanging: one box per rank, "No DDP flags to recommend", and the script's failing flags in the JSON.
    """
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "head_outside_forward.py")], tmp_path, timeout=240)
    assert run.rc == 1, run.output
    outside = [f for f in run.report["findings"] if f["code"] == "used-outside-forward"]
    assert len(outside) == 1 and outside[0]["ranks"] == [0, 1] and outside[0]["steps"] == [0], run.output
    assert "head.bias" in {p["name"] for p in outside[0]["params"]}, outside
    rec = run.report["recommendation"]
    assert rec["static_graph"] is True and rec["find_unused_parameters"] is False, rec
    assert rec["verified"] is True and rec["render"], rec  # flags to apply, in code


def test_a_report_without_a_shown_failure_never_points_at_one() -> None:
    """When the ranks' files explain nothing, the recommendation says where the ranks were instead of pointing at
    a failure the report does not show."""
    from ddp_doctor.core.rankfiles import Outcome
    from ddp_doctor.core.rankstate import RankState
    from ddp_doctor.launch.outcome import _failure_report

    states = {
        r: RankState(rank=r, world_size=2, outcome=Outcome.REPORTED, step=3, phase="between steps", ddp_models=1)
        for r in (0, 1)
    }
    report = _failure_report(states, timed_out=False, interrupted=None, native=[])
    assert not [f for f in report.findings if f.severity in ("error", "warning")], report.findings
    assert "Fix the failure above" not in report.recommendation.reason, report.recommendation.reason
    assert "rank 0 at step 3, between steps; rank 1 at step 3, between steps" in report.recommendation.reason


def test_a_model_sized_from_rank_local_data_names_each_parameter_and_its_shape_per_rank(tmp_path: Path) -> None:
    """Each rank sizes its embedding by its own shard's vocabulary: DDP's constructor refuses the model on rank 1.
    The check reports param-shapes-differ (not 'failed before it built a DDP model' and a traceback)."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "local_vocab.py")], tmp_path)
    assert run.rc == 1, run.output
    assert run.codes == {"param-shapes-differ"}, run.output
    f = run.finding("param-shapes-differ")
    assert run.params("param-shapes-differ") == {"embed.weight"}
    assert "embed.weight is [9, 16] on rank 0, [11, 16] on rank 1" in f["detail"], f
    assert "tests/scripts/local_vocab.py:38" in f["detail"] and "broadcast" in f["fix"], f
    assert "failed on rank 1 before it built" not in run.output and "Traceback" not in run.output, run.output
    assert run.report["backend"] == "gloo" and run.report["torch_version"], run.report  # the header is whole


def test_a_lazy_layer_wrapped_before_its_first_forward_gets_ddps_own_error(tmp_path: Path) -> None:
    """lazy_module.py (its docstring has the ground truth). The check's own step before DDP's constructor read the
    shapes of the uninitialised parameters and failed inside ddp_doctor with torch's *Can't access the shape of an
    uninitialized parameter*; DDP's constructor now raises its own error, as under torchrun."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "lazy_module.py")], tmp_path)
    assert run.rc == 2 and run.report is not None and run.report["findings"] == [], run.output
    said = run.report["error"]
    assert "Modules with uninitialized parameters" in said and "Can't access the shape" not in run.output, said


def test_a_layer_frozen_on_rank_0_alone_before_the_wrap_names_its_parameters(tmp_path: Path) -> None:
    """Ground truth under plain torchrun: both ranks fail in DDP's constructor, 'DDP expects same model across all
    ranks, but Rank 0 has 2 params, while rank 1 has inconsistent 4 params' (exit 1). The check names the frozen
    layer's parameters and the ranks that train them, not 'failed before it built a DDP model' and a traceback."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "freeze_rank0.py")], tmp_path)
    assert run.rc == 1 and run.codes == {"param-shapes-differ"}, run.output
    assert run.params("param-shapes-differ") == {"0.weight", "0.bias"}
    found = run.finding("param-shapes-differ")
    assert found["ranks"] == [0, 1], found
    trainable = {m["name"]: m["value"] for m in found["measured"]}
    assert trainable == {"trainable_parameters (rank 0)": 2, "trainable_parameters (rank 1)": 4}, found
    assert "Traceback" not in run.output, run.output


def test_every_rank_saving_one_checkpoint_then_ending_early_is_named(tmp_path: Path) -> None:
    """Every rank torch.saves the wrapper's state dict to one file after 3 steps, then destroys its group: the check
    (torch.save wrapped before the script) names the path, both ranks and the line, and the 'module.' keys."""
    out = tmp_path / "ckpt.pt"
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "checkpoint_every_rank.py"), "--out", str(out)], tmp_path)
    assert run.rc == 0, run.output  # a warning: below the default --fail-on error
    assert run.codes == {"checkpoint-same-path", "checkpoint-module-prefix"}, run.output
    same = run.finding("checkpoint-same-path")
    assert str(out) in same["title"] and same["ranks"] == [0, 1] and same["steps"] == [2], same
    assert "tests/scripts/checkpoint_every_rank.py:23" in same["detail"], same
