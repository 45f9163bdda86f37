"""The divergence causes on hand-built records (no process group): each rule fires on its own evidence, names
the ranks and steps, and stays quiet on the evidence of the legitimate patterns next to it."""

from __future__ import annotations

import pytest
import torch
from purerecords import ALL, info, record

from ddp_doctor.core.records import StepCounters
from ddp_doctor.doctor.pipeline import analyze

CAUSES = {
    "optimizer-differs",
    "optimizer-step-skipped",
    "grads-reduced-twice",
    "replicas-differ-at-wrap",
    "weights-changed-outside-optimizer",
}


def counters(rows: list[dict]) -> torch.Tensor:
    base = {"ddp_forwards": 1, "micro_steps": 1, "synced_backwards": 1, "optimizer_step": 1, "optimizer_digest": 7}
    return torch.tensor([StepCounters(**{**base, **row}).as_list() for row in rows])


def weights(diverge_from: int | None, rank: int) -> torch.Tensor:
    w = torch.zeros(4, 4, 2, dtype=torch.float64)
    if diverge_from is not None and rank:
        w[diverge_from:] += 1.0
    return w


def found(records, **info_overrides) -> dict:
    d = analyze(info(**info_overrides), records)
    return {f.code: f for f in d.findings}


def test_a_step_one_rank_skipped_in_lockstep_is_optimizer_step_skipped_not_a_collective_mismatch() -> None:
    same = counters([{}] * 3)
    skipped = counters([{}, {"optimizer_step": 0, "optimizer_digest": 0}, {}])
    f = found(
        [record(0, ALL, counters=same, weights=weights(2, 0)), record(1, ALL, counters=skipped, weights=weights(2, 1))]
    )
    assert set(f) & CAUSES == {"optimizer-step-skipped"} and "collective-mismatch" not in f
    assert (f["optimizer-step-skipped"].ranks, f["optimizer-step-skipped"].steps) == ([1], [1])
    assert f["replica-divergence"].caused_by == ["optimizer-step-skipped"]


def test_a_rank_that_skips_no_step_but_runs_an_extra_synced_pass_is_still_a_collective_mismatch() -> None:
    one = counters([{}] * 3)
    extra = counters([{"synced_backwards": 2, "micro_steps": 2}, {}, {}])
    f = found([record(0, ALL, counters=one), record(1, ALL, counters=extra)])
    assert "optimizer-step-skipped" not in f and f["collective-mismatch"].ranks == [1]


def test_optimizer_settings_that_differ_at_a_step_every_rank_took() -> None:
    rows0 = counters([{}, {}, {}])
    rows1 = counters([{}, {"optimizer_digest": 9, "scheduler_steps": 0}, {"optimizer_digest": 9}])
    rows0[1, StepCounters.FIELDS.index("scheduler_steps")] = 1
    r0 = record(0, ALL, counters=rows0, weights=weights(2, 0))
    r1 = record(1, ALL, counters=rows1, weights=weights(2, 1))
    r0.optimizer_log = [
        f"step {s}: group 0 (4 tensors) lr={lr}, momentum=0.9" for s, lr in enumerate((0.1, 0.05, 0.05))
    ]
    r1.optimizer_log = [f"step {s}: group 0 (4 tensors) lr=0.1, momentum=0.9" for s in range(3)]
    r0.scheduler_sites = ["step 1: StepLR.step() at train.py:31"]
    f = found([r0, r1])
    assert set(f) & CAUSES == {"optimizer-differs"}
    d = f["optimizer-differs"]
    assert (d.ranks, d.steps, d.sites) == ([0, 1], [1], ["train.py:31"])  # the scheduler's line
    # The setting that differs, lr, with each rank's value.
    assert {m.name: (m.value, m.unit) for m in d.measured} == {
        "group 0 lr (rank 0)": (pytest.approx(0.05), "value"),
        "group 0 lr (rank 1)": (pytest.approx(0.1), "value"),
    }
    assert d.labels == {"call": "StepLR.step()"}  # the scheduler's call
    assert "train.py:31" in d.fix


def test_a_step_some_ranks_skipped_is_not_also_an_optimizer_difference() -> None:
    skipped = counters([{}, {"optimizer_step": 0, "optimizer_digest": 0}, {}])
    f = found([record(0, ALL, counters=counters([{}] * 3)), record(1, ALL, counters=skipped)])
    assert "optimizer-differs" not in f


def test_gradients_reduced_again_give_the_line_the_op_and_the_factor() -> None:
    rows = counters([{"grads_rereduced": 4}] * 3)
    records = [record(r, ALL, counters=rows) for r in range(2)]
    for r in records:
        r.rereduce_sites = [f"step {s}: all_reduce(float32[4, 3])/2 at train.py:40" for s in range(3)]
    f = found(records)
    assert set(f) == {"grads-reduced-twice"} and f["grads-reduced-twice"].severity == "error"
    twice = f["grads-reduced-twice"]
    assert (twice.sites, twice.steps) == (["train.py:40"], [0, 1, 2])
    # A SUM over a group of 2: each gradient 2 times what DDP computed.
    assert {m.name: (m.value, m.unit) for m in twice.measured} == {
        "gradient_factor": (2, "ratio"),
        "group_size": (2, "count"),
    }, twice.measured
    assert twice.labels == {"call": "all_reduce(float32[4, 3])", "reduction": "SUM"}, twice.labels
    for r in records:
        r.rereduce_sites = [f"step {s}: all_reduce(float32[4, 3], AVG)/2 at train.py:40" for s in range(3)]
    averaged = found(records)["grads-reduced-twice"]
    assert averaged.severity == "warning"
    assert {m.name: m.value for m in averaged.measured} == {"gradient_factor": 1, "group_size": 2}  # unchanged


def test_replicas_that_differ_before_the_first_step_say_init_sync() -> None:
    records = [record(r, ALL, weights=weights(0, r)) for r in range(2)]
    f = found(records, ddp_config={"find_unused_parameters": False, "static_graph": False, "init_sync": False})
    assert (f["replicas-differ-at-wrap"].ranks, f["replicas-differ-at-wrap"].steps) == ([0, 1], [0])
    assert f["replicas-differ-at-wrap"].labels == {"init_sync": "False"}  # the flag that explains it
    assert f["replica-divergence"].caused_by == ["replicas-differ-at-wrap"]


def test_weights_written_outside_the_optimizer_on_one_rank_name_the_rank_the_line_and_the_parameters() -> None:
    r0 = record(0, ALL, counters=counters([{"changed_outside": 1}, {}, {}]), weights=weights(1, 0))
    r1 = record(1, ALL, counters=counters([{}] * 3), weights=weights(1, 1))
    r0.changed_sites = ["step 0: 1 parameter tensor(s), load_state_dict at resume.py:12"]
    r0.changed_params = [2]
    f = found([r0, r1])
    w = f["weights-changed-outside-optimizer"]
    # Step 0: between DDP's wrap and the first forward.
    assert (w.ranks, w.steps, w.param_names, w.sites) == ([0], [0], ["head_a.weight"], ["resume.py:12"])
    assert w.labels == {"call": "load_state_dict"}  # the call that wrote them


def test_a_write_on_every_rank_alike_is_no_cause() -> None:
    rows = counters([{"changed_outside": 4}] * 3)
    assert "weights-changed-outside-optimizer" not in found([record(r, ALL, counters=rows) for r in range(2)])


def test_a_divergence_no_cause_explains_says_it_is_unknown_and_what_was_ruled_out() -> None:
    f = found([record(r, ALL, weights=weights(2, r)) for r in range(2)])
    assert not set(f) & CAUSES and f["replica-divergence"].caused_by == []  # unknown: no finding explains it
    assert f["replica-divergence"].ruled_out == [  # what was looked for and not seen
        "grads-changed-after-sync",
        "optimizer-differs",
        "optimizer-step-skipped",
        "replicas-differ-at-wrap",
        "weights-changed-outside-optimizer",
    ]


def _edited(rank: int, changed: bool, *, measured: int = 1, sites: tuple[str, ...] = ()) -> object:
    """A rank whose gradients agreed with the others' after DDP's all-reduce; `changed`: it edited parameter 2's
    before the step (its `grad_fp` differs from its `synced_grad_fp` there)."""
    synced = torch.arange(3 * 4 * 2, dtype=torch.float64).reshape(3, 4, 2)
    at_step = synced.clone()
    if changed:
        at_step[:, 2] *= 0.5
    r = record(rank, ALL, grad=at_step, counters=counters([{"grads_measured": measured}] * 3), weights=weights(1, rank))
    r.synced_grad_fp = synced if changed else None
    r.grad_edit_sites = list(sites)
    return r


def test_gradients_edited_on_one_rank_after_the_all_reduce_name_the_rank_the_parameter_and_the_line() -> None:
    sites = tuple(f"step {s}: clip_grad_norm_(max_norm=0.5) at train.py:30" for s in range(3))
    f = found([_edited(0, True, sites=sites), _edited(1, False)])
    g = f["grads-changed-after-sync"]
    assert (g.ranks, g.steps, g.param_names) == ([0], [0, 1, 2], ["head_a.weight"]), g
    assert g.sites == ["train.py:30"] and "train.py:30" in g.fix
    # where they were compared (a closure's: when the step returned), and the call seen between backward and step
    assert g.labels == {"kind": "call", "call": "clip_grad_norm_(max_norm=0.5)", "compared_at": "step-begin"}
    assert "grads-not-synced" not in f  # they agreed after DDP's all-reduce: not a sync problem
    d = f["replica-divergence"]
    # The evidence links them, both ways (the divergence's fix is the cause's); the drift is measured.
    assert d.caused_by == ["grads-changed-after-sync"] and g.explains == ["replica-divergence"]
    assert [(m.name, m.unit) for m in d.measured] == [("largest_sum_difference", "abs")] and d.measured[0].value > 0


def test_a_closure_based_step_says_where_its_gradients_were_measured() -> None:
    g = found([_edited(0, False, measured=2), _edited(1, True, measured=2)])["grads-changed-after-sync"]
    assert g.ranks == [1] and g.labels == {"kind": "grad-write", "compared_at": "step-return"}
    assert g.sites == []  # no clipping call seen: the gradients were written in place


def test_an_unexplained_divergence_says_where_the_gradients_were_compared() -> None:
    fix = found([_edited(r, False) for r in range(2)])["replica-divergence"].fix
    assert "the gradients agreed after ddp's all-reduce and when optimizer.step() began" in fix.lower(), fix
    fix = found([_edited(r, False, measured=0) for r in range(2)])["replica-divergence"].fix
    assert "no optimizer step was seen" in fix and "when optimizer.step()" not in fix, fix


def test_the_same_edit_on_every_rank_is_no_cause() -> None:
    assert "grads-changed-after-sync" not in found([_edited(r, True) for r in range(2)])
