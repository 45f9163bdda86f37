"""Round B of the check's exchange: every fact of one rank's record that needs only the common step count. Its SUM
half is here (bit planes counted over the ranks, read back as `Counted`); its MAX half, the digests and per-step
counters compared over the ranks, is `compared.py`. The MAX goes first: it also tells which bit planes are the same
on every rank, and those are not sent in the SUM."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from ddp_doctor.core.codes import Code
from ddp_doctor.core.records import CRASH_KINDS, RankRecord
from ddp_doctor.exchange.common_steps import Agreed
from ddp_doctor.exchange.compared import Compared, Mine, put_compared
from ddp_doctor.exchange.packing import MaxRound, Op, Reply, SumRound, bool_digest, of_record, text_digest

__all__ = ["SAVE_BUCKETS", "Counted", "Facts", "LocalFacts", "exchange_facts", "local_facts", "training_loader"]

SAVE_BUCKETS = 16
"""Buckets the paths a rank wrote with torch.save are hashed into (`checkpoint-same-path`): a fixed shape."""


@dataclass
class LocalFacts:
    """What the rounds after B read of this rank's facts."""

    bypassed: bool
    """Some step ran the module's forward without DDP's (the model called around the wrapper)."""
    empty_steps: bool
    """Some common step had no trainable parameter."""
    loader: dict[str, Any] | None
    """The training loader (`training_loader`)."""
    save_counts: torch.Tensor
    """int64[SAVE_BUCKETS]: 1 where this rank wrote a file whose path hashes into the bucket."""
    save_digests: torch.Tensor
    """int64[SAVE_BUCKETS]: the XOR of those paths' digests (MAX == MIN over the ranks: the same paths)."""
    bucket_of: dict[str, int]
    """Each saved path's bucket."""


@dataclass(kw_only=True, slots=True)
class Counted:
    """Round B's SUM read back: over the ranks, how many set each bit (int64, the shape of what each rank put)."""

    used: torch.Tensor
    """[S, P]: ranks on which the parameter got a gradient in the step."""
    trainable: torch.Tensor
    """[S, P]: ranks on which it required grad at the end of the step."""
    ran: torch.Tensor
    """[P]: its module ran in some common step."""
    partial: torch.Tensor
    """[P]: used or reachable in the step a crash interrupted."""
    varies: torch.Tensor
    """[P]: used in some common steps and not in others."""
    after_crash: torch.Tensor
    """[P]: used in the interrupted step but not in every common step."""
    bypass_used: torch.Tensor
    """[P]: used in a step that ran the wrapped module without DDP's forward."""
    bypass_steps: torch.Tensor
    """[pad_steps]: steps with such a bypass."""
    empty: torch.Tensor
    """[pad_steps]: steps with no parameter requiring grad."""
    missing: torch.Tensor
    """[P]: without a gradient in the last complete step of a rank that hit the reduction error."""
    rank0_trainable: torch.Tensor
    """[P]: group rank 0's requires_grad at the end of the last common step."""
    crash_steps: torch.Tensor
    """[len(CRASH_KINDS), pad_steps + 2]: index ``crash_step + 1`` for each crash kind."""
    buffer_nan: torch.Tensor
    """[S, B]: the buffer's fingerprint is NaN (not recorded)."""
    input: torch.Tensor
    """[S]: a nonzero input fingerprint."""
    loader: torch.Tensor
    """[1]: ranks that iterated a DataLoader with a length."""
    saves: torch.Tensor
    """[SAVE_BUCKETS]: ranks that wrote a file whose path hashes into the bucket."""
    bn_training: torch.Tensor
    """[S]: BatchNorm layers in training mode in the step's first forward."""


@dataclass(slots=True)
class Facts:
    """Round B's result: the group's counts and comparisons, and what this rank put into them."""

    counted: Counted
    compared: Compared
    local: LocalFacts
    mine: Mine


def exchange_facts(
    record: RankRecord, agreed: Agreed, *, ignored: torch.Tensor, rank: int, world: int
) -> Generator[Op, Reply, Facts]:
    """Round B: one MAX (`compared.py`, with the digests of the SUM's bit planes), then one SUM of the planes that
    differ somewhere."""
    b = SumRound(world)
    local = local_facts(b, record, agreed, rank=rank)
    m = MaxRound()
    mine = put_compared(
        m,
        b.digests(),
        record,
        agreed,
        loader=local.loader,
        saves=(local.save_counts, local.save_digests),
        ignored=ignored,
        rank=rank,
        world=world,
    )
    compared = Compared(**m.read((yield ("max", m.tensor()))))
    del m
    b.settle(compared.sections)
    counted = Counted(**b.read((yield ("sum", b.tensor()))))
    return Facts(counted=counted, compared=compared, local=local, mine=mine)


def training_loader(record: RankRecord) -> dict[str, Any] | None:
    """The first loader the rank iterated while observed that has a length (the training loop's, in practice)."""
    return next((d for d in record.loaders if d.get("batches") is not None), None)


def local_facts(b: SumRound, record: RankRecord, agreed: Agreed, *, rank: int) -> LocalFacts:
    """Fill round `b` with this rank's facts over the common steps (shapes padded to the longest record) and
    return what the later rounds need."""
    s, lead, pad_steps = agreed.steps, agreed.lead, agreed.pad_steps
    n_params = record.used.shape[1]
    none = torch.zeros(n_params, dtype=torch.bool)
    used, trainable = record.used[:s], record.trainable[:s]
    partial = record.used[lead] | record.reachable[lead] if lead < record.steps else none
    b.bits("used", used, of_record(record, "used", s, bool_digest))
    b.bits("trainable", trainable, of_record(record, "trainable", s, bool_digest))
    b.bits("ran", record.ran[:s].any(0) if s else none)
    b.bits("partial", partial)
    b.bits("varies", used.any(0) != used.all(0) if s >= 2 else none)
    b.bits("after_crash", partial & ~used.all(0) if s >= 1 else none)
    forwards, bypasses = record.counter("ddp_forwards"), record.counter("bypass_forwards")
    hits = ((bypasses > 0) & (forwards == 0)).nonzero().flatten().tolist()
    bypass_used = none.clone()
    for step in hits:
        bypass_used |= record.used[step]
    hit_steps = torch.zeros(pad_steps, dtype=torch.bool)
    hit_steps[hits] = True
    b.bits("bypass_used", bypass_used)
    b.bits("bypass_steps", hit_steps)
    empty = torch.zeros(pad_steps, dtype=torch.bool)
    if s:
        empty[:s] = ~trainable.any(-1)
    b.bits("empty", empty)
    # A reduction error in a second backward pass through the forward it crashed in (Lightning prepares DDP's
    # reduction at each manual_backward): what the first pass left without a gradient; otherwise what the last
    # complete step did.
    after_pass = lead < record.steps and int(record.counter("split_passes")[lead]) > 0
    reduction_error = CRASH_KINDS[record.crash_kind] == Code.REDUCTION_ERROR and (lead or after_pass)
    missing = (~record.used[lead] if after_pass else ~record.used[lead - 1]) if reduction_error else none
    b.bits("missing", missing)
    b.bits("rank0_trainable", trainable[-1] if rank == 0 and s else none)
    crash_steps = torch.zeros(len(CRASH_KINDS), pad_steps + 2, dtype=torch.bool)
    if record.crash_kind:
        crash_steps[record.crash_kind, min(max(record.crash_step + 1, 0), pad_steps + 1)] = True
    b.bits("crash_steps", crash_steps)
    b.bits("buffer_nan", record.buffer_fp[:s].isnan().all(-1))
    b.bits("input", (record.input_fp[:s] != 0).any(-1))
    loader = training_loader(record)
    b.ints("loader", torch.tensor([int(loader is not None)]))
    # The files written with torch.save, hashed into a fixed number of buckets: how many ranks wrote into each
    # (SUM) and whether their paths there agree (MAX == MIN of the bucket's digest); `checkpoint-same-path`.
    save_counts = torch.zeros(SAVE_BUCKETS, dtype=torch.int64)
    digests = [0] * SAVE_BUCKETS
    bucket_of: dict[str, int] = {}
    for saved in record.saves:
        h = text_digest(saved["path"])
        k = h % SAVE_BUCKETS
        save_counts[k] = 1
        digests[k] ^= h
        bucket_of[saved["path"]] = k
    b.ints("saves", save_counts)
    b.bits("bn_training", record.counter("batchnorm_training")[:s] > 0)
    return LocalFacts(
        bypassed=bool(hits),
        empty_steps=bool(empty.any()),
        loader=loader,
        save_counts=save_counts,
        save_digests=torch.tensor(digests, dtype=torch.int64),
        bucket_of=bucket_of,
    )
