"""Rounds B2 and B3 of the check's exchange, both conditional: the gradients the optimizer step used, compared over
the ranks. B2 runs only when some parameter's requires_grad differs across ranks in some step: the gradient digests
again, masked by the parameters every rank trains (the mask round B could not know yet). B3 runs only when some
gradient differs at the step: the same digests as DDP's all-reduce left them. Those that agreed then were changed
on some ranks after DDP reduced them (clipping on one rank); the others were never synchronized."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from ddp_doctor.core.records import ModelInfo, RankRecord
from ddp_doctor.exchange.compared import Pair, grad_hashes
from ddp_doctor.exchange.facts import Facts
from ddp_doctor.exchange.packing import MaxRound, Op, Reply, differs, hash_steps, of_record

__all__ = ["Differing", "GradDigests", "Synced", "differing", "edited_after_sync", "masked_by_trained"]


@dataclass(frozen=True, slots=True)
class GradDigests:
    """The gradient digests at the optimizer step, over the parameters to compare."""

    p: Pair
    """int64[P]: per parameter over the common steps."""
    s: Pair
    """int64[S]: per step over the parameters."""
    mask: torch.Tensor
    """bool[S, P]: this rank's mask (trainable here, or by every rank after B2; not ignored by DDP)."""
    mine: torch.Tensor
    """int64[P]: this rank's digest, masked (round B3 reuses it where nothing changed the gradients after the
    sync)."""


def masked_by_trained(
    record: RankRecord, facts: Facts, *, s: int, ignored: torch.Tensor, world: int
) -> Generator[Op, Reply, GradDigests]:
    """Round B2: one MAX of the digests masked by what every rank trains, when requires_grad differs across ranks
    in some step; otherwise round B's digests stand, and nothing is sent."""
    c, trainable = facts.compared, facts.counted.trainable
    train_all = trainable == world
    if bool(((trainable == 0) | train_all).all()):
        return GradDigests(p=c.grad_p, s=c.grad_s, mask=facts.mine.grad_mask, mine=facts.mine.grad_p)
    b2 = MaxRound()
    mask = train_all & ~ignored
    grad_h = grad_hashes(record, s)
    grad_p = (grad_h * mask).sum(0)
    b2.pair("grad_p", grad_p)
    b2.pair("grad_s", (grad_h * mask).sum(1))
    del grad_h
    r2 = b2.read((yield ("max", b2.tensor())))
    return GradDigests(p=r2["grad_p"], s=r2["grad_s"], mask=mask, mine=grad_p)


@dataclass(frozen=True, slots=True)
class Differing:
    """What the group knows after rounds B and B2: which gradients and weights differ, and what DDP reduces."""

    tracked: torch.Tensor
    """bool[P]: the parameters DDP's reducer reduces (trainable at wrap, minus any inferred unfrozen)."""
    unsynced: torch.Tensor
    """bool[P]: gradients differ in some common step, unmasked (only when the wrap state is inferred)."""
    grad_params: torch.Tensor
    """bool[P]: gradients differ at the optimizer step."""
    grad_steps: torch.Tensor
    """bool[S]."""
    weight_params: torch.Tensor
    """bool[P]: weights differ before or after some common step."""
    weight_steps: torch.Tensor
    """bool[S + 1]."""


def differing(facts: Facts, grads: GradDigests, info: ModelInfo, *, s: int, world: int) -> Differing:
    """Local: no collective."""
    n_params = len(info.param_names)
    tracked = torch.tensor(info.trainable_at_wrap, dtype=torch.bool)
    ignored = torch.tensor(info.ignored, dtype=torch.bool)
    c = facts.compared
    infer = facts.mine.infer
    unsynced = differs(c.unsynced) if infer and c.unsynced is not None else torch.zeros(n_params, dtype=torch.bool)
    if infer:
        extra = int(tracked.sum()) - int(info.wrap_trainable_count or 0)
        if extra > 0 and int((unsynced & tracked).sum()) == extra:
            tracked = tracked & ~unsynced
    none = torch.zeros(n_params, dtype=torch.bool)
    return Differing(
        tracked=tracked,
        unsynced=unsynced,
        grad_params=differs(grads.p) & ~ignored if world >= 2 else none,
        grad_steps=differs(grads.s) if world >= 2 else torch.zeros(s, dtype=torch.bool),
        weight_params=differs(c.weight_p) & ~ignored if world >= 2 else none,
        weight_steps=differs(c.weight_s) if world >= 2 else torch.zeros(s + 1, dtype=torch.bool),
    )


@dataclass(frozen=True, slots=True)
class Synced:
    """Round B3's result."""

    edited: torch.Tensor
    """bool[P]: gradients that differ at the step but agreed after DDP's all-reduce."""
    my_edits: torch.Tensor
    """bool[S]: steps in which this rank changed one of them between its synced backward and the step."""


def edited_after_sync(
    record: RankRecord, grads: GradDigests, grad_params: torch.Tensor, *, s: int
) -> Generator[Op, Reply, Synced]:
    """Round B3: one MAX of the digests of the gradients as DDP's all-reduce left them, when some gradient differs
    at the optimizer step; otherwise nothing is sent."""
    if not bool(grad_params.any()):
        return Synced(edited=torch.zeros_like(grad_params), my_edits=torch.zeros(s, dtype=torch.bool))
    b3 = MaxRound()
    if record.synced_grad_fp is None:  # the same gradients at the sync as at the step: round B's digest
        b3.pair("synced_p", grads.mine)
    else:
        b3.pair("synced_p", (of_record(record, "synced_grad_fp", s, hash_steps) * grads.mask).sum(0))
    r3 = b3.read((yield ("max", b3.tensor())))
    edited = grad_params & ~differs(r3["synced_p"])
    my_edits = torch.zeros(s, dtype=torch.bool)
    if record.synced_grad_fp is not None and s:
        before, after = record.synced_grad_fp[:s], record.grad_fp[:s]
        changed = ~((before == after) | (before.isnan() & after.isnan())).all(-1)  # [S, P]
        my_edits = (changed & grads.mask & edited).any(1)
    return Synced(edited=edited, my_edits=my_edits)
