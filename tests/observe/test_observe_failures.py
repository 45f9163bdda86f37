"""observe() when the rank fails: DDP's reduction error explained with the parameters' names and chained, the
position a crash leaves published, the used set published before DDP waits in its all-reduce, every rank's traceback
collected, and a rank's own explanation never advising to freeze what it trained."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ddpsteps import sgd_model, train_step
from dist import RankFailure, run_ranks
from scenarios import batch

from ddp_doctor import ReductionError, observe


def _reduction_error(rank: int, world: int) -> dict:
    ddp, opt = sgd_model()
    doctor = observe(ddp, optimizer=opt)
    with pytest.raises(ReductionError) as info, doctor:
        for step in range(3):
            train_step(ddp, opt, rank, step, use_b=False)
    report = doctor.report(timeout=20)
    return {
        "message": str(info.value),
        "cause": type(info.value.__cause__).__name__,
        "params": info.value.params,
        "text": str(report),
    }


def test_reduction_error_is_explained_with_names_and_chained(tmp_path) -> None:
    result = run_ranks(_reduction_error, tmp_path)[0]
    assert result["cause"] == "RuntimeError"
    assert result["params"] == ["head_b.weight", "head_b.bias"]
    assert "head_b.weight, head_b.bias" in result["message"] and "static_graph=True" in result["message"]
    assert "reduction-error" in result["text"] and "head_b.weight (64)" in result["text"]


def _crash_mid_step(rank: int, world: int) -> dict:
    ddp, opt = sgd_model()
    published: list[tuple[int, str]] = []
    doctor = observe(ddp, optimizer=opt)
    doctor.on_phase = lambda d: published.append((d.position.step, str(d.position.phase)))
    with pytest.raises(ValueError), doctor:
        for step in range(3):
            x, y = batch(rank, step)
            loss = F.mse_loss(ddp(x, use_b=True), y)
            if step == 2:
                raise ValueError("corrupt sample")
            loss.backward()
            opt.step()
            opt.zero_grad()
    return {"last": published[-1], "steps": doctor.steps_observed}


def test_a_crash_leaves_the_published_position_where_the_step_failed(tmp_path) -> None:
    # Closing the crashed step must not publish "step 3, between steps": a rank stopped before it writes its
    # own crash record is reported by its last published position (seen in CI as "rank 0 was at step 4").
    expected = {"last": (2, "after forward, before backward"), "steps": 3}
    assert run_ranks(_crash_mid_step, tmp_path) == [expected] * 2


def _used_set_news(rank: int, world: int) -> list:
    ddp, opt = sgd_model(find_unused_parameters=True)
    news: list[tuple[int, str, tuple[int, list[str]]]] = []
    doctor = observe(ddp, optimizer=opt)
    doctor.on_phase = lambda d: (
        d.position.used_set_news and news.append((d.steps_observed, str(d.position.phase), d.position.missing_grads()))
    )
    with doctor:
        train_step(ddp, opt, rank, 0, use_b=False)
    return news


def test_the_used_set_is_published_before_ddp_waits_for_the_all_reduce(tmp_path) -> None:
    # A rank stuck in DDP's all-reduce for a peer that never reduces still tells which parameters it trained.
    missing = (0, ["head_b.weight", "head_b.bias"])
    # Published once, before the wait; closing the step does not publish (and compute) it again.
    assert run_ranks(_used_set_news, tmp_path) == [[(0, "backward", missing)]] * 2


def test_rank_failure_collects_every_traceback(tmp_path) -> None:
    with pytest.raises(RankFailure, match=r"(?s)--- rank 1 ---.*boom on rank 1"):
        run_ranks(_fail_on_rank_1, tmp_path, timeout=30)


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def _explained(used: list[list[int]], ran: list[list[int]]) -> str:
    """The reduction error a rank explains after the given steps (head_b = parameter 1)."""
    from ddp_doctor.core.records import TIMING_COLUMNS, ModelInfo, RankRecord, StepCounters
    from ddp_doctor.observation.crash import explain_failure

    info = ModelInfo(
        param_names=["trunk.weight", "head_b.weight"],
        param_shapes=[(4, 4), (2, 4)],
        trainable_at_wrap=[True, True],
        ignored=[False, False],
        buffer_names=[],
        buffer_shapes=[],
        ddp_config={},
    )
    steps = len(used)
    u = torch.tensor(used, dtype=torch.bool)
    c = StepCounters(ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1)
    record = RankRecord(
        rank=1,
        used=u,
        reachable=u.clone(),
        ran=torch.tensor(ran, dtype=torch.bool),
        trainable=torch.ones(steps, 2, dtype=torch.bool),
        grad_fp=torch.zeros(steps, 2, 2, dtype=torch.float64),
        weight_fp=torch.zeros(steps + 1, 2, 2, dtype=torch.float64),
        buffer_fp=torch.zeros(steps, 0, 2, dtype=torch.float64),
        input_fp=torch.zeros(steps, 2, dtype=torch.float64),
        timing=torch.zeros(steps, TIMING_COLUMNS, dtype=torch.float64),
        counters=torch.tensor([c.as_list()] * steps),
    )
    exc = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    return str(
        explain_failure(exc, kind="reduction-error", rank=1, info=info, record=record, crash_in_window=True, hint="")
    )


def test_a_rank_never_advises_freezing_what_it_trained_in_another_step() -> None:
    # head_b got a gradient in step 0 and none in step 1: the script trains it, the set changes.
    text = _explained(used=[[1, 1], [1, 0]], ran=[[1, 1], [1, 0]])
    assert "head_b.weight" in text and "keep them trainable" in text and "requires_grad=False" not in text
    # Its module ran but no gradient reached it: still meant to train.
    text = _explained(used=[[1, 0]], ran=[[1, 1]])
    assert "keep them trainable" in text and "requires_grad=False" not in text
    # Never ran, never got a gradient on this rank: freezing is one of the conditional fixes.
    text = _explained(used=[[1, 0], [1, 0]], ran=[[1, 0], [1, 0]])
    assert "if they are never meant to train, set requires_grad=False" in text
