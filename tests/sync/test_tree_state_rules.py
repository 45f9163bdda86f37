"""What the module tree held beyond DDP's lists, on hand-built records (no process group): parameters DDP's reducer
does not hold (`unregistered-parameters`), what a replaced module left in the reducer (never advised to freeze),
and modules whose mode differs across ranks (`replica-divergence`)."""

from __future__ import annotations

import torch
from purerecords import ALL, info, record

from ddp_doctor.core.records import StepCounters
from ddp_doctor.doctor.pipeline import analyze

NEW_HEAD = [{"name": "head_c.weight", "shape": [2, 4], "site": "train.py:31"}]


def counters(rows: list[dict]) -> torch.Tensor:
    base = {"ddp_forwards": 1, "micro_steps": 1, "synced_backwards": 1, "optimizer_step": 1}
    return torch.tensor([StepCounters(**{**base, **row}).as_list() for row in rows])


def found(records) -> dict:
    d = analyze(info(), records)
    return {f.code: f for f in d.findings}, d.recommendation


def _unregistered(rank: int, digests: list[int], fp: list[float] = (1.0, 2.0)):
    """`fp`: the parameter's fingerprints at the last step, which the digests fold in."""
    r = record(rank, ALL, counters=counters([{"unregistered": 1, "state_digest": d} for d in digests]))
    r.unregistered = [{**NEW_HEAD[0], "fp": list(fp)}]
    r.state_log = [{"step": 0, "training": True, "other_mode": [], "other_mode_count": 0, "unregistered": ["x"]}]
    return r


def test_parameters_the_reducer_does_not_hold_that_part_across_ranks_are_an_error_naming_them() -> None:
    f, _ = found([_unregistered(0, [5, 6, 7]), _unregistered(1, [5, 9, 11], fp=[1.0, 3.0])])
    u = f["unregistered-parameters"]
    assert u.severity == "error" and [p.name for p in u.params] == ["head_c.weight"] and u.params[0].numel == 8
    assert u.ranks == [0, 1] and u.steps == [0, 1]  # attached from step 0, parted at step 1
    assert "train.py:31" in u.fix and "replica-divergence" not in f  # the values, not the modes, differ


def test_parameters_the_reducer_does_not_hold_that_still_agree_are_a_warning() -> None:
    f, _ = found([_unregistered(0, [5, 6, 7]), _unregistered(1, [5, 6, 7])])
    assert f["unregistered-parameters"].severity == "warning" and f["unregistered-parameters"].steps == [0]


def test_parameters_that_agree_stay_a_warning_when_something_else_the_digest_covers_differs() -> None:
    """The digests part at step 1 for a teacher run beside the model; the parameters' own fingerprints agree."""
    recs = [_unregistered(0, [5, 6, 7]), _unregistered(1, [5, 9, 11])]
    for r, fp in zip(recs, ([1.0, 1.0], [2.0, 2.0])):
        r.beside_modules = [{"name": "teacher", "site": "t.py:9", "tensors": 2, "numel": 8, "fp": fp}]
    f, _ = found(recs)
    u = f["unregistered-parameters"]
    assert u.severity == "warning" and u.steps == [0], u
    assert f["replica-divergence"].param_names == ["teacher"] and f["replica-divergence"].steps == [1]
    # both differ: the parameters are an error, at the last step (which part parted first is not known)
    recs[1].unregistered[0]["fp"] = [1.0, 3.0]
    f, _ = found(recs)
    assert f["unregistered-parameters"].severity == "error" and f["unregistered-parameters"].steps == [0, 2]


def test_what_a_replaced_module_left_in_the_reducer_is_never_named_unused_nor_frozen() -> None:
    """head_b (position 3) got no gradient on any step: the module was replaced, its old parameter stays in DDP."""
    used = [[1, 1, 1, 0]] * 3
    recs = []
    for rank in (0, 1):
        r = record(rank, used, ran=[[1, 1, 1, 0]] * 3, counters=counters([{"unregistered": 1}] * 3))
        r.unregistered, r.orphaned = NEW_HEAD, [3]
        recs.append(r)
    f, rec = found(recs)
    assert "unused-parameters" not in f and "unregistered-parameters" in f
    assert rec.freeze_before_wrap == [] and rec.find_unused_parameters is False and rec.static_graph is True
    # The same record without the replacement: head_b is plain unused, and the advice is to freeze it.
    for r in recs:
        r.orphaned, r.unregistered = [], []
        r.counters = counters([{}] * 3)
    f, rec = found(recs)
    assert [p.name for p in f["unused-parameters"].params] == ["head_b.weight"] and rec.freeze_before_wrap == [
        "head_b.weight"
    ]


def test_a_module_in_eval_mode_on_one_rank_is_named_with_the_step_and_both_modes() -> None:
    train = {"training": True, "other_mode": [], "other_mode_count": 0, "unregistered": []}
    recs = []
    for rank in (0, 1):
        digests = [1, 1, 1] if rank == 1 else [1, 2, 2]
        r = record(rank, ALL, counters=counters([{"state_digest": d} for d in digests]))
        r.state_log = [{"step": 0, **train}] + ([{"step": 1, **train, "training": False}] if rank == 0 else [])
        recs.append(r)
    f, _ = found(recs)
    d = f["replica-divergence"]
    assert d.severity == "warning" and d.ranks == [0, 1] and d.steps == [1]
    assert "unregistered-parameters" not in f
    # Its fix is its own (the modes), not the one of diverged weights whose cause is unknown.
    assert "model.train()" in d.fix and "cause is unknown" not in d.fix
