"""sync_gradients: a correct manual gradient all-reduce, for the rare loop that cannot go through DDP's forward.

The first fix for a bypassed DDP wrapper is to call the wrapper (``loss_fn(ddp_model(x))``), which gives DDP's
bucketed reducer that overlaps communication with the backward pass. This is the fallback. The hand-written
version people reach for (``for p in params: if p.grad is not None: dist.all_reduce(p.grad)``) is slow
(one collective per tensor) and hangs when a grad is None on one rank only, because the ranks then issue different
numbers of collectives. Here every rank issues the same collectives with the same shapes, whatever its grads:

1. One fixed-shape all_reduce of a plan fingerprint (a hash of the trainable parameters' names, shapes and dtypes,
   their count, and local error flags). If the ranks disagree, every rank raises `RankMismatchError` together.
2. The plan: every trainable parameter in `module.parameters()` order, grouped by (device, dtype), cut into
   buckets of at most `bucket_mb` MiB by shapes alone, so the layout is identical on every rank.
3. Per bucket, one all_reduce(SUM) of the flattened grads (a None grad contributes zeros) plus one presence flag
   per parameter. A parameter whose grad is None on every rank keeps a None grad (as DDP does); one that is None
   on some ranks only gets the reduced gradient.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.compat import parameters_to_ignore
from ddp_doctor.core.errors import InvalidArgumentError
from ddp_doctor.core.ranks import other_ranks
from ddp_doctor.exchange.primitives import Headers, agree, comm_device, layout_hash
from ddp_doctor.observation.wrapstate import require_process_group

__all__ = ["sync_gradients"]

_SPARSE, _WRONG_SHAPE = 1, 2


@dataclass(frozen=True, slots=True)
class _Bucket:
    indices: tuple[int, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True, slots=True)
class _Plan:
    key: tuple[object, ...]
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    buckets: tuple[_Bucket, ...]
    hash: int


_plans: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def sync_gradients(
    module: nn.Module, *, group: dist.ProcessGroup | None = None, bucket_mb: float = 25, average: bool = True
) -> int:
    """All-reduce the gradients of `module`'s trainable parameters, bucketed, with the same plan on every rank.

    Call it on every rank after ``loss.backward()`` and before ``optimizer.step()``. Prefer calling the DDP
    wrapper so that DDP synchronizes the gradients itself; this function is for the loops that cannot.

    Args:
        module: the model (the module inside DDP, or the DDP wrapper itself; for a wrapper, its process group is
            the default and the parameters DDP ignores are skipped).
        group: the process group to reduce over (default: the DDP's group, or the default group).
        bucket_mb: the largest bucket, in MiB; a bigger tensor gets a bucket of its own.
        average: divide the sum by the group's size (what DDP does); False leaves the sum.

    Returns:
        The number of gradient bytes all-reduced (every trainable parameter's, present or not).

    Raises:
        ProcessGroupNotInitializedError: `torch.distributed` is not initialized.
        InvalidArgumentError: `module` is not an `nn.Module`, `bucket_mb` is not positive, or a grad is sparse or
            has the wrong shape (raised on every rank).
        RankMismatchError: the ranks disagree on the trainable parameter list (raised on every rank).

    Example:
        >>> loss = model.module.compute_loss(batch)    # a loop that bypasses DDP's forward
        >>> loss.backward()
        >>> ddp_doctor.sync_gradients(model)            # every rank, before the optimizer step
        >>> opt.step(); opt.zero_grad()
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgumentError(f"sync_gradients() needs an nn.Module, got {type(module).__qualname__}.")
    require_process_group("sync_gradients()")
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise InvalidArgumentError(f"bucket_mb must be a positive number of MiB, got {bucket_mb!r}. Try 25.")
    if isinstance(module, DistributedDataParallel):
        if group is None:
            group = module.process_group
        ignore = parameters_to_ignore(module)
        module = module.module
    else:
        ignore = frozenset()
    plan = _plan(module, ignore, int(bucket_mb * 2**20))
    world = dist.get_world_size(group)
    device = comm_device(group, plan.params[0].device if plan.params else None)

    # 1. Agree on the plan (and on local errors) before any gradient collective, so shapes always match.
    flags = 0
    for p in plan.params:
        g = p.grad
        if g is not None:
            if g.is_sparse:
                flags |= _SPARSE
            elif g.shape != p.shape:
                flags |= _WRONG_SHAPE
    headers = agree(
        [plan.hash, len(plan.params)],
        failed=flags,
        group=group,
        device=device,
        what="sync_gradients() found that the ranks disagree on the trainable parameter list",
        cause="names, shapes, dtypes or requires_grad",
        describe=lambda h: f"{int(h[1])} trainable tensors",
        fix=f"This rank has {len(plan.params)}"
        + (f", first {plan.names[0]!r}" if plan.names else "")
        + ". Nothing was reduced on any rank. Build the same model on every rank and change requires_grad "
        "identically on every rank.",
    )
    if headers is not None:
        _raise_bad_grads(headers)

    # 2. Reduce the buckets; issue them all before waiting on any, so packing overlaps communication.
    pending = []
    for bucket in plan.buckets:
        parts = []
        present = []
        for i, n in zip(bucket.indices, bucket.numels):
            g = plan.params[i].grad
            if g is None:
                parts.append(torch.zeros(n, dtype=bucket.dtype, device=bucket.device))
                present.append(0.0)
            else:
                parts.append(g.detach().reshape(-1).to(bucket.dtype))
                present.append(1.0)
        parts.append(torch.tensor(present, dtype=bucket.dtype, device=bucket.device))
        flat = torch.cat(parts)
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))

    total = 0
    for bucket, flat, work in pending:
        work.wait()
        n_grads = flat.numel() - len(bucket.indices)
        if average:
            flat[:n_grads].div_(world)
        tail = flat[n_grads:]
        # A sum of 0/1 flags: in any float dtype, a sum of non-negative numbers is > 0 exactly when one was 1.
        anywhere = (tail.real if tail.is_complex() else tail) > 0
        views = torch.split(flat[:n_grads], bucket.numels)
        for i, view, seen in zip(bucket.indices, views, anywhere.tolist()):
            p = plan.params[i]
            if p.grad is not None:
                p.grad.copy_(view.view(p.shape))
            elif seen:
                p.grad = torch.empty_like(p).copy_(view.view(p.shape))
        total += n_grads * flat.element_size()
    return total


def _plan(module: nn.Module, ignore: frozenset[str], cap_bytes: int) -> _Plan:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignore]
    key = (
        cap_bytes,
        ignore,
        tuple(id(p) for _, p in named),
        tuple((p.dtype, p.device, tuple(p.shape)) for _, p in named),
    )
    cached = _plans.get(module)
    if cached is not None and cached.key == key:
        return cached
    open_buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    open_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
    done: list[list[int]] = []
    for i, (_, p) in enumerate(named):
        slot = (p.device, p.dtype)
        size = p.numel() * p.element_size()
        if slot in open_buckets and open_bytes[slot] + size > cap_bytes:
            done.append(open_buckets.pop(slot))
        if slot not in open_buckets:
            open_buckets[slot], open_bytes[slot] = [], 0
        open_buckets[slot].append(i)
        open_bytes[slot] += size
    done += open_buckets.values()
    buckets = tuple(
        _Bucket(
            indices=tuple(idx),
            numels=tuple(named[i][1].numel() for i in idx),
            dtype=named[idx[0]][1].dtype,
            device=named[idx[0]][1].device,
        )
        for idx in sorted(done, key=lambda b: b[0])
    )
    described = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named]
    plan = _Plan(
        key=key,
        names=tuple(n for n, _ in named),
        params=tuple(p for _, p in named),
        buckets=buckets,
        hash=layout_hash(described),
    )
    _plans[module] = plan
    return plan


def _raise_bad_grads(headers: Headers) -> None:
    """Some rank cannot reduce its grads; every rank raises the same error (`headers` is equal on every rank)."""
    what = "; ".join(
        f"rank {r}: "
        + " and ".join(
            w
            for bit, w in ((_SPARSE, "a sparse grad"), (_WRONG_SHAPE, "a grad whose shape is not its param's"))
            if f & bit
        )
        for r, f in zip(headers.ranks, headers.codes)
        if f
    )
    if headers.more_failed:
        what += ";" + other_ranks(headers.more_failed)
    raise InvalidArgumentError(
        f"sync_gradients() cannot reduce these gradients ({what}); nothing was reduced on any rank. It handles "
        "dense grads shaped like their parameters; for sparse embeddings use DDP itself."
    )
