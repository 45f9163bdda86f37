"""sync_gradients(): equal to a reference average in the cases that break the hand-written loop, and never a hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import run_ranks
from scenarios import Net, batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import InvalidArgumentError, RankMismatchError, sync_gradients


def _reference(params: list[nn.Parameter], world: int, *, average: bool = True) -> list[torch.Tensor | None]:
    """Every rank's local grads gathered (None as zeros) and averaged; None where no rank had a grad."""
    out: list[torch.Tensor | None] = []
    for p in params:
        local = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        has = torch.tensor([float(p.grad is not None)])
        grads = [torch.empty_like(local) for _ in range(world)]
        flags = [torch.empty_like(has) for _ in range(world)]
        dist.all_gather(grads, local)
        dist.all_gather(flags, has)
        if not any(bool(f) for f in flags):
            out.append(None)
            continue
        total = torch.stack([g.double() for g in grads]).sum(0)
        out.append((total / world if average else total).to(p.dtype))
    return out


def _gathered_equal(t: torch.Tensor) -> bool:
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, t.contiguous())
    return all(torch.equal(copies[0], c) for c in copies[1:])


def _none_on_one_rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    x, y = batch(rank, 0)
    # Rank 0 uses head_b, the others do not: its grad is None on those ranks only. This is the case where the
    # hand-written per-parameter loop (all_reduce only where p.grad is not None) issues different numbers of
    # collectives on the ranks and hangs.
    F.mse_loss(model(x, use_b=rank == 0), y).backward()
    params = list(model.parameters())
    expected = _reference(params, world)
    nbytes = sync_gradients(model)
    got = [p.grad for p in params]
    return {
        "head_b_had_grad": model.head_b.weight.grad is not None,
        "close": all(torch.allclose(g, e, rtol=1e-6, atol=1e-7) for g, e in zip(got, expected)),
        "bitwise": all(torch.equal(g, e) for g, e in zip(got, expected)),
        "equal_across_ranks": all(_gathered_equal(g) for g in got),
        "bytes": nbytes,
        "numel": sum(p.numel() for p in params),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_none_grad_on_one_rank_only(tmp_path, world) -> None:
    results = run_ranks(_none_on_one_rank, tmp_path, world_size=world)
    for r, res in enumerate(results):
        assert res["head_b_had_grad"], f"rank {r}: head_b should get the reduced grad (rank 0 had one)"
        assert res["close"] and res["equal_across_ranks"], f"rank {r}: {res}"
        assert res["bytes"] == 4 * res["numel"]
    if world == 2:  # (a + b) / 2 is what the reference computes too: bit-identical
        assert all(res["bitwise"] for res in results)


def _none_everywhere_stays_none(rank: int, world: int) -> tuple[bool, bool]:
    torch.manual_seed(0)
    model = Net()
    x, y = batch(rank, 0)
    F.mse_loss(model(x), y).backward()  # head_b unused on every rank
    sync_gradients(model)
    return model.head_b.weight.grad is None, model.head_a.weight.grad is not None


def test_grad_none_on_every_rank_stays_none(tmp_path) -> None:
    assert run_ranks(_none_everywhere_stays_none, tmp_path) == [(True, True)] * 2


class Mixed(nn.Module):
    """float32, float64 and bfloat16 parameters in one model, interleaved."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8).double()
        self.c = nn.Linear(8, 8).to(torch.bfloat16)
        self.d = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = self.b(h.double()).float()
        h = self.c(h.to(torch.bfloat16)).float()
        return self.d(h)


def _mixed_dtypes(rank: int, world: int, bucket_mb: float) -> dict:
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    params = list(model.parameters())
    expected = _reference(params, world)
    sync_gradients(model, bucket_mb=bucket_mb)
    return {
        "dtypes": sorted({str(p.grad.dtype) for p in params}),
        "bitwise": [torch.equal(p.grad, e) for p, e in zip(params, expected)],
        "same_dtype": all(p.grad.dtype == p.dtype for p in params),
    }


@pytest.mark.parametrize("bucket_mb", [25, 1e-4])
def test_mixed_dtypes(tmp_path, bucket_mb) -> None:
    for res in run_ranks(_mixed_dtypes, tmp_path, args=(bucket_mb,)):
        assert res["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float64"]
        assert all(res["bitwise"]), res
        assert res["same_dtype"]


def _many_small(rank: int, world: int, average: bool) -> dict:
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(3, 3) for _ in range(150)])  # 300 tensors of 9 and 3 elements
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    loss = sum(layer(x).sum() * (i + 1) for i, layer in enumerate(model))
    loss.backward()
    params = list(model.parameters())
    expected = _reference(params, world, average=average)
    sync_gradients(model, bucket_mb=100 / 2**20, average=average)  # ~100-byte buckets: many of them
    return {"n": len(params), "bitwise": all(torch.equal(p.grad, e) for p, e in zip(params, expected))}


@pytest.mark.parametrize("average", [True, False])
def test_many_small_tensors_and_buckets(tmp_path, average) -> None:
    assert run_ranks(_many_small, tmp_path, args=(average,)) == [{"n": 300, "bitwise": True}] * 2


def _mismatched_lists(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Net()
    if rank == world - 1:
        model.head_b.bias.requires_grad_(False)  # one rank disagrees on the trainable list
    x, y = batch(rank, 0)
    F.mse_loss(model(x, use_b=True), y).backward()
    with pytest.raises(RankMismatchError) as info:
        sync_gradients(model)
    return str(info.value)


def test_mismatched_parameter_lists_raise_on_every_rank(tmp_path) -> None:
    messages = run_ranks(_mismatched_lists, tmp_path, world_size=3, timeout=60)
    for m in messages:
        assert "rank 0: 8 trainable tensors, rank 1: 8 trainable tensors, rank 2: 7 trainable tensors" in m
        assert "Nothing was reduced on any rank" in m


def _loss_through_module(rank: int, world: int) -> tuple[bool, bool]:
    """A loop that computes the loss through ddp.module, with sync_gradients: replicas stay identical, like with DDP."""
    torch.manual_seed(0)
    ddp = DDP(Net())
    reference = DDP(Net())
    reference.module.load_state_dict(ddp.module.state_dict())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(rank, step)
        F.mse_loss(ddp.module(x, use_b=True), y).backward()  # bypasses DDP's reducer
        sync_gradients(ddp)
        opt.step()
        opt.zero_grad()
        F.mse_loss(reference(x, use_b=True), y).backward()  # through the wrapper
        opt_ref.step()
        opt_ref.zero_grad()
    same = all(_gathered_equal(p.detach()) for p in ddp.parameters())
    matches = all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(ddp.parameters(), reference.parameters()))
    return same, matches


def test_bypassed_loop_with_sync_matches_ddp(tmp_path) -> None:
    assert run_ranks(_loss_through_module, tmp_path) == [(True, True)] * 2


def _bad_input(rank: int, world: int) -> list[str]:
    messages = []
    for call in (
        lambda: sync_gradients("model"),  # type: ignore[arg-type]
        lambda: sync_gradients(nn.Linear(2, 2), bucket_mb=0),
    ):
        with pytest.raises(InvalidArgumentError) as info:
            call()
        messages.append(str(info.value))
    emb = nn.Embedding(10, 4, sparse=True)
    if rank == 0:  # sparse grad on one rank only: still refused on every rank, no collective mismatch
        emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(InvalidArgumentError) as info:
        sync_gradients(emb)
    messages.append(str(info.value))
    return messages


def test_bad_input(tmp_path) -> None:
    for messages in run_ranks(_bad_input, tmp_path):
        assert "needs an nn.Module, got str" in messages[0]
        assert "bucket_mb must be a positive number of MiB, got 0" in messages[1]
        assert "rank 0: a sparse grad" in messages[2]
