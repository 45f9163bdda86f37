"""Gradient clipping under FSDP2 scales every rank's gradient shards by one coefficient: the ratio of each rank's
shards' norm at the optimizer step to the same at the end of the backward, compared across ranks
(`observation/grad_scale.py`; `grads-changed-after-sync` when it differs).

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps of tests/scripts/fsdp2_train.py (two
micro-batches a step, sync on for both): no clip, head.weight ends summing -1.496532 on both ranks;
`clip_grad_norm_(model.parameters(), 0.05)` on every rank (`--mistake clip`, a global norm over the DTensor
gradients) -1.439474; the same clip from each rank's own shards (`--mistake local-clip`: the norm of
`p.grad.to_local()`, each rank scaling its shards by its own coefficient) -1.573953, exit code 0, nothing said.
`clip_grad_norm_` on rank 0 alone (`--mistake clip-rank0`) hangs: the norm of DTensor gradients is a collective,
which only rank 0 calls (ended by torchrun's timeout here; the hang tests cover that kind). Its silent neighbours,
exit code 0: `clip_grad_value_(model.parameters(), 0.01)` on rank 0 alone (`--mistake value-clip-rank0`: elementwise,
no collective) -1.661447; each rank dividing its gradient shards by its own batch's count of non-zero labels
(`--mistake token-norm`, a per-token mean from the rank's own batch) -1.578808.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkrun import SCRIPTS, check

SCRIPT = str(SCRIPTS / "fsdp2_train.py")


def _check(tmp_path: Path, mistake: str, *more: str):
    args = ["--nproc-per-node", "2", "--no-verify", SCRIPT, "--mistake", mistake, *more]
    return check(args, tmp_path, timeout=240)


@pytest.mark.parametrize(
    "mistake, steps",
    [
        # every measured step (the first is before the model is found) clips on both ranks, each by its own norm
        ("local-clip", list(range(1, 8))),
        ("value-clip-rank0", list(range(1, 8))),
        # the steps whose batches hold different counts of non-zero labels on the two ranks
        ("token-norm", [2, 3, 6, 7]),
    ],
)
def test_shards_scaled_by_each_ranks_own_factor_are_named_with_the_steps(tmp_path: Path, mistake, steps) -> None:
    run = _check(tmp_path, mistake)
    assert run.rc == 1 and run.codes == {"grads-changed-after-sync"}, run.output
    f = run.finding("grads-changed-after-sync")
    assert f["severity"] == "error" and f["ranks"] == [0, 1], f
    measured = {m["name"]: m["value"] for m in f["measured"]}
    assert f["steps"] == steps and measured["steps_measured"] == 7, f
    assert measured["largest_scale_ratio"] > 1.01, measured


@pytest.mark.parametrize("mistake", ["clip", "none", "accumulate"])
def test_a_global_clip_or_none_is_measured_and_clean(tmp_path: Path, mistake: str) -> None:
    run = _check(tmp_path, mistake)
    assert run.rc == 0 and run.report["findings"] == [], run.output
    assert run.report["compared"]["gradient_scale_steps"] == 7, run.report["compared"]
