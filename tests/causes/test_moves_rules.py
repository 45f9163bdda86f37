"""Whether training moves, on hand-built records: non-finite gradients, all-zero gradients, steps that change no
weight, and the neighbours that must stay quiet (a GradScaler's skipped step, one step of warm-up at lr 0)."""

from __future__ import annotations

import torch
from purerecords import ALL, info, record

from ddp_doctor.core.records import StepCounters, encode_scale
from ddp_doctor.doctor.pipeline import analyze


def _record(rank: int, rows: list[dict], **kw):
    base = {"ddp_forwards": 1, "micro_steps": 1, "synced_backwards": 1, "optimizer_step": 1, "grads_present": 4}
    r = record(rank, ALL, counters=torch.tensor([StepCounters(**{**base, **row}).as_list() for row in rows]))
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def found(rows: list[dict], **kw) -> dict:
    d = analyze(info(), [_record(0, rows, **kw), _record(1, rows, **kw)])
    return {f.code: f for f in d.findings}


def test_non_finite_gradients_are_named_with_the_first_step_and_the_parameters() -> None:
    rows = [{"weights_moved": 4}, {"grads_nonfinite": 2, "weights_nonfinite": 2, "weights_moved": 4}, {}]
    f = found(rows, nonfinite_params=[0, 1])
    assert f["non-finite-values"].steps == [1] and [p.name for p in f["non-finite-values"].params] == [
        "trunk.weight",
        "trunk.bias",
    ]


def test_a_model_materialised_with_to_empty_is_named_as_the_likely_cause() -> None:
    rows = [{"grads_nonfinite": 4, "weights_nonfinite": 4}] * 3
    f = found(rows, nonfinite_params=[0, 1, 2, 3], to_empty_sites=["train.py:12"])
    assert "to_empty()" in f["non-finite-values"].detail and "train.py:12" in f["non-finite-values"].detail
    assert "reset_parameters" in f["non-finite-values"].fix


def test_a_grad_scalers_skipped_step_is_not_a_non_finite_finding() -> None:
    scale = encode_scale(65536.0)
    rows = [{"grads_nonfinite": 4, "scaler_scale": scale}] + [{"weights_moved": 4, "scaler_scale": scale}] * 2
    assert "non-finite-values" not in found(rows)


def test_all_zero_gradients_at_every_step_are_training_stalled() -> None:
    f = found([{"grads_zero": 4}] * 3)
    assert f["training-stalled"].steps == [0, 1, 2] and "exactly zero" in f["training-stalled"].title


def test_all_zero_gradients_are_training_stalled_even_when_weight_decay_moves_the_weights() -> None:
    """AdamW's decoupled weight decay moves every weight at each step whatever the gradient: zero gradients at every
    step are still a job that does not train (tests/causes/test_check_fsdp2_moves.py: largest change 0.0003)."""
    f = found([{"grads_zero": 4, "weights_moved": 4}] * 3)["training-stalled"]
    assert f.steps == [0, 1, 2] and {m.name: m.value for m in f.measured}["steps_with_all_gradients_zero"] == 3


def test_a_learning_rate_of_0_at_every_step_is_named_and_one_warm_up_step_is_not() -> None:
    f = found([{}] * 3, learning_rates=[0.0])
    assert "learning rate is 0" in f["training-stalled"].title
    assert "training-stalled" not in found([{}, {"weights_moved": 4}, {"weights_moved": 4}], learning_rates=[0.1])
