"""Two backward passes through one DDP forward (issue #32, item 3): a GAN whose generator and discriminator live in
one module, both losses computed from ONE forward (tests/scripts/gan_two_passes.py).

Measured with plain torchrun (torch 2.13.0+cpu, gloo, 2 ranks), `d_loss.backward(retain_graph=True)` then
`g_loss.backward()` after one forward, both optimizers stepped after both passes:
- default flags: step 0's second backward crashes, "Expected to mark a variable ready only once" (the discriminator
  is reached by both passes; DDP prepares one reduction per forward);
- find_unused_parameters=True: step 0 runs, but the generator's weights differ across ranks after it (max 0.0197),
  then step 1 crashes, "Encountered gradient which is undefined, but still allreduced by DDP reducer";
- static_graph=True: the same silent drift at step 0, then "Your training graph has changed" at step 1.
Neighbours, same measurement:
- `g_loss.backward(inputs=generator params)` (each parameter gets its gradient in exactly one pass): the default
  flags reduce correctly, replicas identical after 4 steps (DDP reduces the union once, when the second pass
  completes the buckets); find_unused_parameters=True crashes at step 1 as above, static_graph=True drifts (the
  generator differs by 0.0197, 0.0277, 0.0397 after steps 0-2).
- the order reversed (the generator's loss first, reaching every parameter): every flag runs without an error and
  the discriminator's weights drift apart silently (0.104, 0.0872, 0.115 after steps 0-2): the first pass completes
  DDP's reduction, the second is never reduced.
- two passes whose used sets are identical: runs with every flag, and the second pass is never reduced (the replicas
  drift: 0.0197 on the generator after step 0).
- each loss's backward after its own forward (`--separate`): the default flags crash at the second forward
  ("Expected to have finished reduction in the prior iteration"), static_graph=True at step 1; only
  find_unused_parameters=True runs, replicas identical after 4 steps. With that flag DDP runs the generator's
  post-accumulate-grad hooks in the discriminator's pass although no gradient reaches it (`.grad` stays None):
  counted as use, that made the check call the flag unneeded.
So no flag fixes two differing passes through one forward in a plain loop: the report must not recommend one.
(Lightning prepares DDP at each manual_backward, where find_unused_parameters=True does work:
tests/integrations/test_lightning_trainer.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

pytestmark = pytest.mark.timeout(300)

DISCRIMINATOR = {"discriminator.0.weight", "discriminator.0.bias", "discriminator.2.weight", "discriminator.2.bias"}
GENERATOR = {"generator.0.weight", "generator.0.bias", "generator.2.weight", "generator.2.bias"}
SCRIPT = "tests/scripts/gan_two_passes.py"


def test_a_crash_in_the_second_pass_is_named_with_both_backward_lines_and_no_flag_advice(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "gan_two_passes.py")], tmp_path, timeout=240)
    assert run.rc == 1 and run.report is not None, run.output
    # Whether the crashed ranks exchange their records (one joint finding) or not (one finding per rank, each
    # explained from its own files) depends on how fast each rank reaches the error.
    assert run.codes == {"backward-passes-differ"}, run.output
    found = [f for f in run.report["findings"] if f["code"] == "backward-passes-differ"]
    assert sorted(r for f in found for r in f["ranks"]) == [0, 1]
    for f in found:
        assert f["severity"] == "error" and f["steps"] == [0], f
        if f["labels"]:  # decided over the exchanged records: no DDP flag helps, and both backward lines
            assert f["labels"] == {"kind": "one-forward", "outcome": "crashed"}, f
            assert f["sites"] == [f"{SCRIPT}:56", f"{SCRIPT}:58"], f
        else:  # explained from the rank's own files: its error, in the explainer's words, with both lines
            assert "find_unused_parameters=True and static_graph=True fail" in f["detail"], f["detail"]
            assert f"{SCRIPT}:56" in f["title"] + f["detail"] and f"{SCRIPT}:58" in f["title"] + f["detail"], f
        assert {p["name"] for p in f["params"]} <= DISCRIMINATOR | GENERATOR and f["params"], f
    assert "used outside" not in run.output and "grad-blocked" not in run.output
    rec = run.report["recommendation"]
    assert rec["flags_known"] is False and not rec["static_graph"], rec


def test_passes_that_split_the_parameters_exactly_are_a_warning_and_no_flag_is_advised(tmp_path: Path) -> None:
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "gan_two_passes.py"), "--inputs"], tmp_path, timeout=240)
    assert run.rc == 0 and run.report is not None, run.output  # a warning: below the default --fail-on error
    f = run.finding("backward-passes-differ")
    assert f["severity"] == "warning" and f["ranks"] == [0, 1], f
    assert f["steps"] == list(range(run.report["steps_observed"])), f
    assert f["sites"] == [f"{SCRIPT}:52", f"{SCRIPT}:54"], f
    assert f["labels"] == {"kind": "one-forward", "outcome": "each-parameter-once"}, f
    # Each pass reached only its own network: every parameter is missing from one of them.
    assert run.params("backward-passes-differ") == DISCRIMINATOR | GENERATOR
    assert not {"grad-blocked", "unused-parameters", "dynamic-graph", "grads-not-synced"} & run.codes, run.output
    rec = run.report["recommendation"]
    assert rec["flags_known"] is False and not rec["static_graph"] and not rec["verified"], rec
    assert "Give each backward pass its own forward" in rec["reason"], rec


def test_each_pass_through_its_own_forward_gets_find_unused_verified_and_nothing_blamed(tmp_path: Path) -> None:
    """`--separate`: the discriminator's pass, then the generator's after a forward of its own. The default flags
    fail at the second forward, before any optimizer step: the steps seen cannot show the generator untrained, so
    no grad-blocked (whose fix, removing the .detach(), would break the GAN), no gradients blamed that no optimizer
    used, and find_unused_parameters=True, never static_graph=True, verified by check's second run."""
    run = check(["--nproc-per-node", "2", str(SCRIPTS / "gan_two_passes.py"), "--separate"], tmp_path, timeout=240)
    assert run.rc == 1 and run.report is not None, run.output
    errors = {f["code"] for f in run.report["findings"] if f["severity"] == "error"}
    assert errors == {"reduction-error"}, run.output
    assert run.params("reduction-error") == GENERATOR
    rec = run.report["recommendation"]
    assert rec["find_unused_parameters"] is True and rec["static_graph"] is False, rec
    assert rec["verified"] is True, rec


def test_each_pass_through_its_own_forward_with_find_unused_is_clean(tmp_path: Path) -> None:
    """The fix applied: the generator reaches the loss in every other forward, so find_unused_parameters=True is
    needed (dynamic-graph, info), not unneeded, and the recommendation is the script's own flags, verified."""
    run = check(
        ["--ddp-kwargs", '{"find_unused_parameters": true}', "--nproc-per-node", "2"]
        + [str(SCRIPTS / "gan_two_passes.py"), "--separate"],
        tmp_path,
        timeout=240,
    )
    assert run.rc == 0 and run.report is not None, run.output
    shown = {f["code"] for f in run.report["findings"] if f["severity"] in ("error", "warning")}
    assert not shown - {"straggler-rank", "input-bound"}, run.output  # timing: 2 ranks sharing 2 busy cores
    assert run.finding("dynamic-graph")["severity"] == "info"
    assert run.params("dynamic-graph") == GENERATOR
    rec = run.report["recommendation"]
    assert rec["find_unused_parameters"] is True and rec["verified"] is True, rec
