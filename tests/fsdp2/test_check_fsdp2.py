"""`ddp-doctor check` on jobs that shard with FSDP2 (`fully_shard`) instead of DDP (tests/scripts/fsdp2_train.py).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 optimizer steps of two micro-batches; every run
ends with exit code 0 and prints nothing but its own line per rank:
- none / accumulate (sync off for the first micro-batch, on for the last): the weights move (largest change 0.109)
  and the head's weight sums are equal on both ranks (-1.496532).
- optimizer-before (the optimizer built before fully_shard): largest weight change 0 on both ranks.
- sync-off (set_requires_gradient_sync(False) on every micro-batch, never back on): largest weight change 0.
- root-unsharded (the blocks sharded, the root with its head not): head.weight sums -2.187345 and -2.443114.
- added-after (everything sharded, then `model.extra = nn.Linear(64, 64)` trained): extra.weight sums -12.648243
  and -1.867362; the sharded head stays equal (-0.749989).
Before the check knew FSDP2, it crashed every one of these jobs in its own fingerprint code ("aten.mul.Tensor got
mixed torch.Tensor and DTensor") and blamed the script.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check
from fsdp2train import SCRIPT, check_mistake, line_of

from ddp_doctor.core.compat import TORCH_VERSION


@pytest.mark.parametrize("mistake", ["none", "accumulate,eval-every,log-every"])
def test_a_clean_fsdp2_job_is_clean_and_its_sharding_is_named(tmp_path: Path, mistake: str) -> None:
    """The clean job, and the clean job the way a real script runs it: gradient accumulation with sync back on for
    the last micro-batch, an evaluation forward on every rank, the loss all_reduced on every rank, and both right ways to checkpoint sharded state (DCP
    on every rank, and a full state dict gathered on every rank, written by rank 0: the two fixes that
    sharded-checkpoint-incomplete gives, applied)."""
    saves = ["--save", "dcp,full", "--save-dir", str(tmp_path)] if "accumulate" in mistake else []
    run = check(["--nproc-per-node", "2", "--no-verify", SCRIPT, "--mistake", mistake, *saves], tmp_path, timeout=180)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    if mistake == "none":  # the last block reshards after its forward: one all-gather per step for nothing
        reshard = run.report["recommendation"]["reshard"]
        # two micro-batches per step, each: the root, then each block in its forward and again in its backward
        assert reshard["module"] == "blocks.1" and reshard["all_gathers_per_step"] == 10, reshard
        assert "verification" not in reshard and not run.report["recommendation"]["verified"]
    else:  # the evaluation forward of step 3 makes its step's all-gathers differ: not counted, nothing advised
        assert "reshard" not in run.report["recommendation"]
    assert run.report["parallelism"] == "fsdp2"
    sharding = run.report["sharding"]
    assert sharding["sharded_modules"] == 3 and sharding["root_sharded"] and sharding["mesh"] == [[2]]
    assert "FSDP2: 3 sharded modules" in run.output and "No problems found in what was compared" in run.output
    compared = run.report["compared"]
    assert (compared["parallelism"], compared["ranks"], compared["steps"], compared["outside_groups"]) == (
        "fsdp2",
        2,
        8,
        0,
    ), compared
    # a save after the observed steps, forwards on some ranks, the policy, skipped steps after them, a write to
    # the weights on some ranks (a 1-D mesh holds each shard once: no replica to compare, `replicas` 0), and modules
    # run beside the model
    unchecked = ["sharded-saves", "calls-some-ranks", "mixed-precision", "optimizer-steps-skipped"]
    unchecked += ["weights-written-some-ranks", "modules-beside"]
    assert [u["what"] for u in run.report["not_checked"]] == unchecked, run.report["not_checked"]
    assert {u["parallelism"] for u in run.report["not_checked"]} == {"fsdp2"}
    assert (compared["replicas"], compared["replica_rows"]) == (0, 0), compared
    assert run.report["steps_observed"] == 8  # the script trains 12 steps; the check stops it after --steps
    assert run.report["recommendation"]["flags_known"] is False and run.report["recommendation"]["static_graph"] is None
    if saves:
        assert (tmp_path / "dcp").is_dir() and (tmp_path / "ck.pt").is_file()


@pytest.mark.parametrize("mistake", ["final-eval", "keep-unsharded", "opaque-buffer"])
def test_state_read_after_an_evaluation_or_unreadable_is_not_taken_for_a_mistake(tmp_path: Path, mistake: str) -> None:
    """final-eval: every rank evaluates once under no_grad after the last of 4 steps (plain torchrun: exit 0, both
    ranks print the same output sum, 0.437783). FSDP2 leaves the root's parameters unsharded after a forward that
    no backward follows: plain tensors registered on the modules in place of the DTensors the optimizer holds. The
    report, read at the script's end, named head.weight and head.bias `unsharded-params-not-synced` ("outside every
    fully_shard group"), and a model with only a root group `optimizer-params-replaced` at error. keep-unsharded
    (`set_reshard_after_backward(False)`, ZeRO-2 style: every parameter stays unsharded from the backward on; plain
    torchrun: exit 0; in a trial with SGD the training losses were the default's at every step, while an evaluation
    right after each optimizer step saw the step before's weights, FSDP2 re-gathering them only at the next training
    forward) read so at every step: `optimizer-params-replaced` at error for a small model in three groups. opaque-buffer: a
    buffer in a tensor subclass without the fingerprint's operations crashed both ranks inside the check (its
    fingerprint of the buffers at the first step); plain torchrun: exit 0."""
    run = check(
        ["--nproc-per-node", "2", "--no-verify", SCRIPT, "--mistake", mistake, "--steps", "4"], tmp_path, timeout=180
    )
    assert run.rc == 0 and run.report["findings"] == [], run.output
    compared = run.report["compared"]
    assert (compared["parameters"], compared["outside_groups"], compared["buffers"]) == (6, 0, 0), compared
    unread = [u["tensors"] for u in run.report["not_checked"] if u["what"] == "unreadable"]
    assert unread == ([["buffer mix (Opaque)"]] if mistake == "opaque-buffer" else []), run.report["not_checked"]


@pytest.mark.parametrize("ranks", [2, 1])
def test_an_optimizer_built_before_fully_shard_is_named_with_its_line(tmp_path: Path, ranks: int) -> None:
    """On one rank too (one GPU, before the job scales out): plain torchrun moves no weight either."""
    run = check_mistake(tmp_path, "optimizer-before", ranks)
    assert run.rc == 1 and run.codes == {"optimizer-params-replaced"}, run.output
    finding = run.finding("optimizer-params-replaced")
    assert finding["severity"] == "error" and finding["ranks"] == list(range(ranks))
    assert finding["sites"] == [f"tests/scripts/{line_of('opt = torch.optim.AdamW(')}"], finding
    labels = {"kind": "built-before-wrap", "optimizer": "AdamW", "weights_moved": "no"}
    assert finding["labels"] == labels, finding
    measured = {m["name"]: m["value"] for m in finding["measured"]}
    assert (measured["model_params"], measured["stale_tensors"]) == (6, 6), measured
    assert "after every fully_shard call" in finding["fix"]


def test_gradient_sync_never_switched_back_on_is_named_with_its_line(tmp_path: Path) -> None:
    run = check_mistake(tmp_path, "sync-off")
    assert run.rc == 1 and run.codes == {"gradient-sync-off"}, run.output
    finding = run.finding("gradient-sync-off")
    assert finding["sites"] == [f"tests/scripts/{line_of('model.set_requires_gradient_sync(False)')}"], finding
    assert "set_requires_gradient_sync(micro_step == accumulation_steps - 1)" in finding["fix"]


def test_the_sync_switches_note_which_call_turned_sync_off_whatever_the_arguments_form() -> None:
    """The patched `set_requires_gradient_sync` / `set_requires_all_reduce` pass every argument on (the flag
    positional or by keyword, `recurse`) and note on the module which call switched sync off, and where."""
    from ddp_doctor.doctor.sharded_report import SYNC_OFF_ATTR
    from ddp_doctor.launch.patches import _noting_sync_off

    calls = []

    class Module:
        pass

    def original(module, requires_all_reduce, *, recurse=True):
        calls.append((requires_all_reduce, recurse))

    switch, module = _noting_sync_off(original, "set_requires_all_reduce"), Module()
    switch(module, requires_all_reduce=False, recurse=False)
    assert getattr(module, SYNC_OFF_ATTR)[0] == "set_requires_all_reduce" and calls == [(False, False)]
    switch(module, True)
    assert getattr(module, SYNC_OFF_ATTR) is None and calls[-1] == (True, True)


def test_hsdp_all_reduce_never_switched_back_on_is_gradient_sync_off_not_unused_parameters(tmp_path: Path) -> None:
    """HSDP on 4 ranks ([2, 2] mesh, tests/scripts/fsdp2_hsdp.py) with `set_requires_all_reduce(False)` on every
    sharded module, never switched back on. Ground truth, plain torchrun, 10 AdamW steps: exit code 0, nothing
    trains: FSDP2 keeps the reduce-scattered gradients aside for the all-reduce across the replicas and gives the
    parameters none (the head sums 0.553585 on every rank, its initial value; 0.171580 without the switch). Before,
    the check called all six parameters `unused-parameters` ("nothing in the loss reaches them") and advised removing
    them or setting requires_grad=False."""
    hsdp = SCRIPTS / "fsdp2_hsdp.py"
    run = check(["--nproc-per-node", "4", "--no-verify", str(hsdp), "--mistake", "all-reduce-off"], tmp_path)
    assert run.rc == 1 and run.codes == {"gradient-sync-off"}, run.output
    finding = run.finding("gradient-sync-off")
    switched = [
        i for i, line in enumerate(hsdp.read_text().splitlines(), 1) if "set_requires_all_reduce(False)" in line
    ]
    assert finding["sites"] == [f"tests/scripts/fsdp2_hsdp.py:{switched[-1]}"], finding
    assert finding["ranks"] == [0, 1, 2, 3] and "set_requires_all_reduce(micro_step" in finding["fix"], finding


@pytest.mark.parametrize(
    ("mistake", "severity", "params", "steps"),
    [
        ("buffer-rank", "error", {"mix"}, list(range(8))),
        ("buffer-stats-rank0", "error", {"mix"}, list(range(8))),
        ("batchnorm", "warning", {"blocks.0.1.running_mean", "blocks.0.1.running_var"}, [7]),
        ("buffer-same", None, set(), None),
    ],
)
def test_buffers_that_differ_across_ranks_are_named(tmp_path: Path, mistake, severity, params, steps) -> None:
    """FSDP2 shards parameters only and never broadcasts a buffer. Ground truth under plain torchrun (12 steps):
    buffer-rank (a constant buffer scaling the input, drawn from each rank's own seed) exits 0 with equal weights
    (head.weight sum -1.585440 on both ranks) and outputs on the same input of -0.037012 on rank 0, -0.028478 on
    rank 1; buffer-same (one seed) gives 0.042000 on both; buffer-stats-rank0 (the buffer zero everywhere, then
    filled on rank 0 alone with its first batch's mean) exits 0 with equal weights (head.weight sum -1.503748) and
    outputs 0.106216 on rank 0, 0.091269 on rank 1; batchnorm exits 0, its running statistics each rank's.
    A constant buffer that differs is an error; running statistics, a warning; equal buffers, nothing."""
    run = check_mistake(tmp_path, mistake)
    if severity is None:
        assert run.rc == 0 and run.codes == set(), run.output
        return
    assert run.codes == {"buffer-divergence"}, run.output
    found = run.finding("buffer-divergence")
    assert found["severity"] == severity and run.params("buffer-divergence") == params, found
    assert found["ranks"] == [0, 1] and found["steps"] == steps, found
    assert run.rc == (1 if severity == "error" else 0), run.output


@pytest.mark.parametrize(
    "mistake, ranks, params, cause",
    [
        ("root-unsharded", 2, {"head.weight", "head.bias"}, "the root module was not sharded"),
        ("root-unsharded", 4, {"head.weight", "head.bias"}, "the root module was not sharded"),
        ("added-after", 2, {"extra.weight", "extra.bias"}, "a module added after sharding"),
    ],
)
def test_parameters_outside_every_group_that_differ_are_named(tmp_path, mistake, ranks, params, cause) -> None:
    run = check_mistake(tmp_path, mistake, ranks)
    assert run.rc == 1 and run.codes == {"unsharded-params-not-synced"}, run.output
    finding = run.finding("unsharded-params-not-synced")
    assert finding["severity"] == "error" and finding["ranks"] == list(range(ranks))
    assert run.params("unsharded-params-not-synced") == params
    assert cause in finding["detail"] and "fully_shard" in finding["fix"]


@pytest.mark.parametrize("sync, severity", [("none", "error"), ("all-reduce", "info")])
def test_ignored_params_are_named_as_the_scripts_to_sync_and_an_info_when_it_does(tmp_path, sync, severity) -> None:
    """tests/scripts/fsdp2_ignored.py (the head passed to fully_shard as ignored_params; ground truth in
    analyze/unsharded.py): nothing syncing it is an error naming ignored_params, not "a module added after
    sharding"; the script averaging its gradients itself is an info, not a warning that nothing syncs them."""
    script = str(SCRIPTS / "fsdp2_ignored.py")
    run = check(["--nproc-per-node", "2", "--no-verify", script, "--sync", sync], tmp_path, timeout=180)
    assert run.rc == (1 if severity == "error" else 0) and run.codes == {"unsharded-params-not-synced"}, run.output
    finding = run.finding("unsharded-params-not-synced")
    assert finding["severity"] == severity and run.params("unsharded-params-not-synced") == {"head.weight", "head.bias"}
    assert finding["labels"] == {"kind": "ignored"} and finding["sites"] == ["tests/scripts/fsdp2_ignored.py:42"]


@pytest.mark.parametrize(
    "mistake, said",
    [
        (
            "ddp-around",
            "DistributedDataParallel was given a Sequential whose modules '0' fully_shard (FSDP2) already sharded",
        ),
        ("meta", "still on the meta device, never materialized or initialised: 2.weight, 2.bias (module '2')"),
    ],
)
def test_a_model_fsdp2_cannot_train_gets_a_clear_error_naming_the_module(tmp_path, mistake, said) -> None:
    """Ground truth, plain torchrun, torch 2.13.0, gloo, 2 ranks: DDP around a model with a fully_shard'ed block
    raises *aten.cat.default got mixed torch.Tensor and DTensor* inside DDP's constructor (its broadcast of rank 0's
    weights); a model built on the meta device, sharded and never materialized raises FSDP2's *FSDP parameters
    should be materialized from meta device before training* at the first forward."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "fsdp2_bad_input.py"), "--mistake", mistake], tmp_path)
    assert run.rc == 2, run.output
    line = next(x for x in run.output.splitlines() if x.startswith("ddp-doctor: error:"))
    assert said in line and ("fully_shard the blocks" in line or "model.to_empty(device=device)" in line), line


def test_a_parameter_no_loss_reaches_is_unused_parameters_at_warning(tmp_path: Path) -> None:
    """Ground truth, plain torchrun, torch 2.13.0, gloo, 2 ranks: a model whose auxiliary head (in the root's
    fully_shard group) no forward calls runs to the end with exit code 0; the head never moves (largest change 0)."""
    run = check_mistake(tmp_path, "unused-aux")
    assert run.codes == {"unused-parameters"}, run.output
    finding = run.finding("unused-parameters")
    assert finding["severity"] == "warning" and run.params("unused-parameters") == {"aux.weight", "aux.bias"}
    assert "FSDP2 raises no error for them" in finding["detail"] and "before fully_shard" in finding["fix"]


@pytest.mark.parametrize("policy", ["bf16-weights", "default-bf16", "assign-bf16"])
def test_a_model_cast_to_bfloat16_before_sharding_under_a_bfloat16_policy_steps_bfloat16_weights(
    tmp_path: Path, policy: str
) -> None:
    """tests/scripts/fsdp2_mixed.py --lr 1e-4, plain torchrun, 2 ranks, 12 AdamW steps, exit code 0 every way: with
    the bfloat16 policy on a float32 model every weight of the first layer changed; with the model cast to bfloat16
    before fully_shard (`--policy bf16-weights`) the optimizer steps bfloat16 weights and 89.3% of that layer's
    weights never changed; 89.2% with the model built under `torch.set_default_dtype(torch.bfloat16)`
    (`default-bf16`), 89.3% with a bfloat16 checkpoint loaded by `load_state_dict(..., assign=True)`
    (`assign-bf16`). The check names each (a warning); its neighbour, the policy on float32 weights, is tested
    above as clean (or low-precision-reduce on 2.13)."""
    script = str(SCRIPTS / "fsdp2_mixed.py")
    run = check(
        ["--nproc-per-node", "2", "--no-verify", script, "--policy", policy, "--lr", "1e-4"], tmp_path, timeout=180
    )
    assert run.rc == 0 and run.codes == {"low-precision-weights"}, run.output
    finding = run.finding("low-precision-weights")
    assert finding["severity"] == "warning" and finding["ranks"] == [0, 1], finding
    assert finding["labels"] == {"weights_dtype": "bfloat16", "param_dtype": "bfloat16"}, finding
    assert run.report["sharding"]["param_dtype"] == ["bfloat16"]


@pytest.mark.parametrize("policy", ["bf16", "bf16-fp32"])
def test_gradients_reduced_in_bfloat16_are_an_info_with_the_measured_difference(tmp_path: Path, policy: str) -> None:
    """tests/scripts/fsdp2_mixed.py, plain torchrun, 2 ranks, 12 steps, exit code 0 both ways. On torch 2.13.0, with
    `MixedPrecisionPolicy(param_dtype=torch.bfloat16)` (reduce_dtype unset: 2.13 reduces in param_dtype) the first
    layer's weight sums to 2.516206 at the end, with reduce_dtype=torch.float32 to 2.522940; the first step's reduced
    gradients of that layer, bfloat16 against float32 reduction: mean relative difference 0.0013, at most 0.0039
    (bfloat16's step) in one element. On torch 2.15.0 both end at 2.522940: with reduce_dtype unset, 2.15 reduces
    in the weights' dtype (float32), so the same script is clean there. The check reads the dtype at FSDP2's
    reduce-scatter, not from the policy."""
    script = str(SCRIPTS / "fsdp2_mixed.py")
    run = check(["--nproc-per-node", "2", "--no-verify", script, "--policy", policy], tmp_path, timeout=180)
    assert run.rc == 0, run.output
    assert run.report["sharding"]["param_dtype"] == ["bfloat16"]
    if policy == "bf16-fp32" or TORCH_VERSION >= (2, 15, 0):
        assert run.report["findings"] == [], run.output
        return
    assert run.codes == {"low-precision-reduce"}, run.output
    finding = run.finding("low-precision-reduce")
    assert finding["severity"] == "info", finding
    labels = {"reduce_dtype": "bfloat16", "weights_dtype": "float32"}
    assert finding["labels"] == {**labels, "policy_param_dtype": "bfloat16", "policy_reduce_dtype": "unset"}, finding
    measured = {m["name"]: (m["value"], m["unit"]) for m in finding["measured"]}
    average, unit = measured["mean_relative_difference"]
    assert 1e-4 < average < 0.0039 and unit == "fraction", measured  # measured, and within bfloat16's step
    assert "reduce_dtype=torch.float32" in finding["fix"]


def test_a_transformer_sharded_like_torchtitan_is_clean_past_the_observed_steps(tmp_path: Path) -> None:
    """tests/scripts/fsdp2_transformer.py: a tiny decoder (embeddings, 3 attention blocks, norm, head), every block
    and the root sharded (the embeddings, final norm and head have no fully_shard of their own: the root's group
    holds them), bfloat16 compute with float32 reduce, gradient clipping over DTensor gradients, a DCP checkpoint on
    every rank every 5 steps, 20 steps. Plain torchrun, 2 ranks: exit code 0, loss 4.97 at step 4 and 4.85 at step
    19 (random tokens: log(128) is 4.85). The check observes 8 steps of the 20 and stops it; nothing to report.

    Its one piece of advice, applied in a second run by the check: reshard_after_forward=False on the last block.
    Ground truth (plain torchrun, dist.all_gather_single counted, 30 steps): 7 all-gathers per step with every block
    resharding (the root, then each block in its forward and again in its backward), 6 with the last block kept,
    and the same weights at the end (out.weight sums 8.714201 both ways); step times 151 and 165 ms against 143 and
    136 ms, two runs each on a loaded 2-core machine (noise of that size)."""
    script = str(SCRIPTS / "fsdp2_transformer.py")
    args = [script, "--mixed-precision", "--save-dir", str(tmp_path / "ck")]
    run = check(["--nproc-per-node", "2", *args], tmp_path, timeout=180)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    sharding = run.report["sharding"]
    assert sharding["sharded_modules"] == 4 and sharding["root_sharded"]
    assert sharding["param_dtype"] == ["bfloat16"] and sharding["reduce_dtype"] == ["float32"]
    assert run.report["steps_observed"] == 8 and (tmp_path / "ck" / "step4").is_dir()
    rec = run.report["recommendation"]
    assert rec["verified"] and rec["reshard"]["module"] == "layers.2", rec
    assert rec["reshard"]["all_gathers_per_step"] == 7 and rec["reshard"]["verified_all_gathers_per_step"] == 6
    assert "fsdp2_transformer.py:73" in rec["reshard"]["site"]
    assert rec["reshard"]["verification"] == {"all_gathers_per_step": 6, "same_findings": True, "error": None}


def test_activation_checkpointing_leaves_the_reshard_advice_on_the_last_block(tmp_path: Path) -> None:
    """The same transformer with each block's forward recomputed in backward (torch.utils.checkpoint, non-reentrant,
    around each sharded block, as many scripts do). Plain torchrun, 2 ranks, 20 steps: exit code 0, the same losses
    as without it (4.9256 at step 14, 4.8506 at step 19). The recomputed forwards run in backward, the last block
    first and the first block last: the check took layers.0 for the last module to run forward and advised
    reshard_after_forward=False there, "verified" (7 -> 6 all-gathers per step), with the claim that its backward
    needs the parameters right after, which is true of the last block only."""
    script = str(SCRIPTS / "fsdp2_transformer.py")
    run = check(["--nproc-per-node", "2", script, "--activation-checkpointing"], tmp_path, timeout=180)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    rec = run.report["recommendation"]
    assert rec["reshard"]["module"] == "layers.2" and rec["verified"], rec


def test_hsdp_on_a_2d_mesh_names_its_dimensions_and_the_unsharded_head(tmp_path: Path) -> None:
    """tests/scripts/fsdp2_hsdp.py: a [2, 2] mesh ("replicate", "shard"), 4 ranks, the root left unsharded. Ground
    truth, plain torchrun, torch 2.13.0, gloo, 10 steps: the head's weight sums end at -0.382839, -0.511844,
    -0.643465 and -0.371040 on ranks 0 to 3 (0.171580 on every rank with the root sharded too)."""
    run = check(
        ["--nproc-per-node", "4", "--no-verify", str(SCRIPTS / "fsdp2_hsdp.py"), "--mistake", "root-unsharded"],
        tmp_path,
    )
    assert run.rc == 1 and run.codes == {"unsharded-params-not-synced"}, run.output
    sharding = run.report["sharding"]
    assert sharding["mesh"] == [[2, 2]] and sharding["mesh_dims"] == ["replicate", "shard"], sharding
    assert "mesh [2, 2] (replicate," in run.output, run.output
    assert run.params("unsharded-params-not-synced") == {"4.weight", "4.bias"}
