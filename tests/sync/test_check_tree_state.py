"""What the module tree holds at each step, whatever created it (tests/scripts/tree_state.py, 2 ranks, 6 steps).

Ground truth under plain torchrun (torch 2.13.0, gloo, `torchrun --nproc-per-node 2 tests/scripts/tree_state.py
OUT --case CASE`; the script measures every parameter's largest difference across ranks at the end):
- replace-head (`model.module.head = nn.Linear(16, 4)` after DDP was built), default flags: exit code 1, both ranks
  fail at step 1 with *Expected to have finished reduction* (the old head's parameters stay in DDP's reducer and get
  no gradient). With `find_unused_parameters=True` it runs to the end, exit code 0, silently: head.weight differs by
  0.032 and head.bias by 0.005 across the ranks, every other parameter is equal. Before the module tree was
  walked, the check said the head "never reached the loss", advised freezing it before wrapping, and called the
  recommendation verified.
- new-param (`model.module.scale = nn.Parameter(torch.ones(4))` after DDP was built; forward multiplies by it):
  exit code 0 with either flag; scale differs by 0.020 across the ranks.
- eval-rank0 (rank 0 calls `model.eval()` after step 2 and never `model.train()`): exit code 0, weights equal
  (DDP averages the gradients), but rank 0 trains without dropout from step 3 on: its gradients come from another
  function than rank 1's.
- dropout-off-rank0 (rank 0 alone switches its Dropout layers to eval mode after step 2, the model itself staying
  in train mode: a main-process callback that turns dropout off late): exit code 0, weights equal, rank 0's Dropout
  in eval mode and rank 1's in train mode at the end.
- lazy-after-wrap / meta-after-wrap (a `LazyLinear` that never runs, or a `Linear` on the meta device, attached
  after the wrap for a later phase): exit code 0, every parameter equal.
- replace-after-opt (the head replaced after DDP and the optimizer were built): with default flags the reduction
  error at step 1; with `find_unused_parameters=True`, exit code 0 and the new head never trains: its weights sum
  to 0.99466 on both ranks at the end, their initial value; the optimizer stepped the old head.
- eval-restored (every rank evaluates through `model.module`, then calls `model.train()`) and ema-inside (an EMA
  copy attached to the model, not trained): exit code 0, every parameter equal. Both must stay clean.
- tie-after-wrap (`model.module.head.weight = model.module.aux.weight` after DDP was built): with default flags
  exit code 1, both ranks fail at step 1 with *Expected to have finished reduction* (the old head.weight stays in
  DDP's reducer and gets no gradient); with `find_unused_parameters=True`, exit code 0 and the shared weight is equal
  on every rank (measured on a 20-step AdamW language-model variant too: 0.0 apart). The same tie made before the
  wrap (tie-before-wrap): exit code 0, every parameter equal. Before, the check called the old head.weight
  "grad-blocked" (its module ran, no gradient reached it: "remove the torch.no_grad() / .detach()").
- cast-after-wrap (`model = model.to(torch.bfloat16)` after DDP was built): exit code 0 with either flag, and no
  gradient is all-reduced (the cast gives each parameter a new gradient accumulator; DDP hooked the old one): after
  6 steps head.weight differs by 0.036 and body.0.weight by 0.023 across the ranks. The same cast before the wrap
  (cast-before-wrap): exit code 0, every parameter equal. Before, the check said `grads-not-synced` with a fix about
  backward passes through `.module` and edits of `.grad`, none of which the script does.
- outside-param (a learnable loss temperature `temp = nn.Parameter(...)` kept beside the model, stepped by the same
  optimizer: `SGD([*model.parameters(), temp])`): exit code 0, every model weight equal, `temp` 0.0099 apart after
  6 steps (each rank steps it from its own gradient). Before, the check called it `optimizer-params-replaced`, "a
  tensor no forward uses", and told the user to build the optimizer after the model. Its neighbours stay equal
  (exit 0, every tensor 0.0 apart): outside-synced (the script all-reduces the gradients of `temp` and of nine
  offsets beside it before the step: ten tensors, counted in full though the record names eight) and
  outside-registered (the fix: `temp` registered on the model before DDP was built, read through `.module`).
  outside-own-opt (the temperature stepped by an Adam of its own, the model by SGD): exit code 0, `temp` 0.00059
  apart after 6 steps; the check said nothing (it followed the model's optimizer only). outside-seeded (the
  temperature drawn from each rank's own seed, its gradient averaged by the script): exit code 0 (1 run in 5 ends
  with gloo's abort at the teardown, as every script here can), `temp` 0.261 apart at the end, the model's weights
  equal. Its finding measures `gradients_apart` (0: the values started apart), so its fix is not to average the
  gradient, which the script already does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

SCRIPT = str(SCRIPTS / "tree_state.py")
HEAD = {"head.weight", "head.bias"}


def _site_of(script: str, statement: str) -> str:
    """`tests/scripts/SCRIPT:N` of the first line holding `statement` (found, not pinned)."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"tests/scripts/{script}:{next(i for i, line in enumerate(lines, 1) if statement in line)}"


def _site(statement: str) -> str:
    return _site_of("tree_state.py", statement)


def _check(tmp_path: Path, case: str, *flags: str):
    return check(
        ["--nproc-per-node", "2", "--steps", "6", SCRIPT, str(tmp_path / "out"), "--case", case, *flags], tmp_path
    )


def test_a_head_replaced_after_wrap_trains_apart_silently_and_is_named_with_its_line(tmp_path: Path) -> None:
    run = _check(tmp_path, "replace-head", "--find-unused")
    found = run.finding("unregistered-parameters")
    assert found["severity"] == "error" and run.params("unregistered-parameters") == HEAD
    assert found["ranks"] == [0, 1] and found["steps"] == [0]  # in the tree from step 0, already apart after it
    site = _site("model.module.head = nn.Linear(16, 4)")
    assert site in found["detail"] and site in found["fix"]
    # The replaced head's old parameters in DDP's reducer are not "unused" parameters to freeze.
    assert "unused-parameters" not in run.codes and "find-unused-unneeded" not in run.codes
    rec = run.report["recommendation"]
    assert rec["freeze_before_wrap"] == [] and rec["verified"] is False
    assert run.rc == 1


def test_a_head_replaced_after_wrap_with_default_flags_explains_the_reduction_error_by_the_replacement(
    tmp_path: Path,
) -> None:
    run = _check(tmp_path, "replace-head")
    assert run.params("unregistered-parameters") == HEAD
    crash = run.finding("reduction-error")
    assert {p["name"] for p in crash["params"]} == HEAD and crash["steps"] == [1]
    assert "freeze" not in crash["fix"].split(";")[0] and "unregistered-parameters" in crash["fix"]
    assert run.report["recommendation"]["freeze_before_wrap"] == []


@pytest.mark.parametrize("flags", [(), ("--find-unused",)])
def test_a_weight_tied_after_wrap_is_named_with_its_line_and_not_called_blocked(tmp_path: Path, flags) -> None:
    run = _check(tmp_path, "tie-after-wrap", *flags)
    found = run.finding("unregistered-parameters")
    assert run.params("unregistered-parameters") == {"head.weight"}, found
    assert found["sites"] == [_site("# tied after the wrap")] and found["ranks"] == [0, 1], found
    assert "grad-blocked" not in run.codes and "unused-parameters" not in run.codes, run.codes
    if flags:  # find_unused_parameters=True tolerates the old tensor: the shared weight trains in sync
        assert found["severity"] == "info" and run.codes == {"unregistered-parameters"}, run.codes
    else:
        assert found["severity"] == "error"
        assert run.finding("reduction-error")["caused_by"] == ["unregistered-parameters"]
    clean = _check(tmp_path / "before", "tie-before-wrap", *flags)
    assert "unregistered-parameters" not in clean.codes and "grad-blocked" not in clean.codes, clean.codes


@pytest.mark.parametrize("flags", [(), ("--find-unused",)])
def test_a_model_cast_after_wrap_is_named_as_the_cause_of_its_unsynced_gradients(tmp_path: Path, flags) -> None:
    run = _check(tmp_path, "cast-after-wrap", *flags)
    found = run.finding("unregistered-parameters")
    assert run.params("unregistered-parameters") == {"body.0.weight", "body.0.bias", *HEAD}, found
    assert found["severity"] == "error" and found["sites"] == [_site("# cast after the wrap")], found
    assert {m["name"]: m["value"] for m in found["measured"]} == {"parameters_converted_after_wrap": 4}, found
    assert run.finding("grads-not-synced")["caused_by"] == ["unregistered-parameters"]
    clean = _check(tmp_path / "before", "cast-before-wrap", *flags)
    assert clean.errors() == [] and "unregistered-parameters" not in clean.codes, clean.codes


def test_a_parameter_created_after_wrap_is_named_with_its_line(tmp_path: Path) -> None:
    run = _check(tmp_path, "new-param")
    found = run.finding("unregistered-parameters")
    assert run.params("unregistered-parameters") == {"scale"} and found["severity"] == "error"
    assert _site("model.module.scale = nn.Parameter(torch.ones(4))") in found["fix"]


@pytest.mark.parametrize(
    "case, statement", [("lazy-after-wrap", "nn.LazyLinear(4)"), ("meta-after-wrap", 'nn.Linear(16, 4, device="meta")')]
)
def test_a_layer_without_data_added_after_wrap_is_named_unused_and_the_job_runs(tmp_path, case, statement) -> None:
    """State the check cannot fingerprint (a LazyLinear never run, a Linear on the meta device) is named, never a
    crash of the job. Before, both jobs died inside the check's scan ("ranks 0, 1 died without a Python error":
    reading the lazy parameter's shape, copying the meta tensor's values), and the finding said "the forward uses
    them" of parameters no gradient ever reached."""
    run = _check(tmp_path, case)
    assert run.rc == 0 and run.codes == {"unregistered-parameters"}, run.output
    found = run.finding("unregistered-parameters")
    assert found["severity"] == "warning" and run.params("unregistered-parameters") == {"probe.weight", "probe.bias"}
    measured = {m["name"]: m["value"] for m in found["measured"]}
    assert measured == {"with_gradient": 0, "holding_data": 0}, found
    assert found["sites"] == [_site(statement)], found
    sizes = {p["name"]: (p["numel"], p["shape"]) for p in found["params"]}
    if case == "lazy-after-wrap":  # no shape yet: no size either (the product of no dimensions read 1)
        assert sizes == {"probe.weight": (0, []), "probe.bias": (0, [])}, sizes
    else:
        assert sizes == {"probe.weight": (64, [4, 16]), "probe.bias": (4, [4])}, sizes


@pytest.mark.parametrize("case, module", [("eval-rank0", "model"), ("dropout-off-rank0", "body.2")])
def test_a_model_left_in_eval_mode_on_rank_0_is_named_at_the_first_step_it_trained_so(tmp_path, case, module) -> None:
    run = _check(tmp_path, case)
    found = run.finding("replica-divergence")
    assert found["severity"] == "warning" and found["ranks"] == [0, 1] and found["steps"] == [3]
    assert module in found["detail"] and run.codes == {"replica-divergence"}, run.output


def test_an_optimizer_built_before_the_head_was_replaced_is_named_and_the_head_said_untrained(tmp_path: Path) -> None:
    run = _check(tmp_path, "replace-after-opt", "--find-unused")
    stale = run.finding("optimizer-params-replaced")
    assert stale["severity"] == "error" and {p["name"] for p in stale["params"]} == HEAD
    found = run.finding("unregistered-parameters")
    assert found["severity"] == "warning" and "no optimizer steps them" in found["title"]
    assert run.rc == 1


def test_a_tensor_the_optimizer_trains_beside_the_model_is_named_and_its_neighbours_stay_clean(tmp_path: Path) -> None:
    run = _check(tmp_path / "apart", "outside-param")
    found = run.finding("unregistered-parameters")
    assert found["severity"] == "error" and found["steps"] == [0] and found["ranks"] == [0, 1]
    assert run.params("unregistered-parameters") == {"temp"}  # the script's variable, found by identity
    assert run.codes == {"unregistered-parameters"}, run.output  # not "a replaced module's" tensor
    assert found["measured"] == [{"name": "gradients_apart", "value": 1, "unit": "count"}], found
    synced = _check(tmp_path / "synced", "outside-synced")
    assert synced.rc == 0 and synced.codes == set(), synced.output
    assert synced.report["compared"]["outside_model"] == 10  # compared, found equal (8 are named in the record)
    own = _check(tmp_path / "own", "outside-own-opt")
    # The Adam is known from its first step, which comes after the model's step 0 closed: compared from step 1 on.
    assert own.params("unregistered-parameters") == {"temp"} and own.finding("unregistered-parameters")["steps"] == [1]
    seeded = _check(tmp_path / "seeded", "outside-seeded").finding("unregistered-parameters")
    assert seeded["steps"] == [0] and seeded["measured"][0]["value"] == 0, seeded  # apart, gradients equal
    fixed = _check(tmp_path / "fixed", "outside-registered")
    assert fixed.rc == 0 and fixed.errors() == [] and fixed.report["compared"]["outside_model"] == 0, fixed.output


@pytest.mark.parametrize("case", ["eval-restored", "ema-inside"])
def test_an_evaluation_that_restores_train_mode_and_an_ema_copy_in_the_model_stay_clean(
    tmp_path: Path, case: str
) -> None:
    run = _check(tmp_path, case)
    assert run.rc == 0 and run.codes == set(), run.output


@pytest.mark.parametrize("sync, statement", [("barrier", "dist.barrier()"), ("all-reduce", "dist.all_reduce(val)")])
def test_a_collective_in_a_rank_0_only_checkpoint_branch_is_named_as_the_first_divergence(
    tmp_path: Path, sync: str, statement: str
) -> None:
    """tests/scripts/ckpt_barrier.py: rank 0 saves at each epoch end and calls `dist.barrier()` inside its
    rank-0-only branch. Under plain torchrun (group timeout 20 s there) both ranks fail after the timeout with gloo's
    *Timed out waiting 20000ms for recv*: rank 0 in the barrier, rank 1 in DDP's gradient all-reduce of its next
    backward; exit code 1, 35 s. The check observes its 8 steps clean and meets the barrier at the epoch end it
    follows. Before, its report said "No problems found" with a note that the ranks could not exchange records, and
    exit code 0. `--sync all-reduce` (rank 0 averages one validation loss across the ranks in that branch): exit code
    1 after 4 s, rank 0 aborted by gloo (*Received data size doesn't match expected size. 180 vs 4*: rank 1's
    gradient bucket met its one float), rank 1 *Connection reset by peer*; torchrun names rank 0's SIGABRT."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "ckpt_barrier.py"), "--sync", sync], tmp_path, timeout=180)
    assert run.rc == 1, run.output
    first = run.report["findings"][0]
    assert first["code"] == "collective-mismatch" and first["ranks"] == [0, 1], first
    # The line DDP was built at joins when rank 1 is already inside that all-reduce as the ranks are read (timing).
    ddp_line = _site_of("ckpt_barrier.py", "model = DistributedDataParallel(")
    assert first["sites"] in (
        [_site_of("ckpt_barrier.py", statement)],
        [_site_of("ckpt_barrier.py", statement), ddp_line],
    ), first
    assert "DDP's next gradient all-reduce" in first["detail"]
