"""Round B of the check's exchange: every fact of one rank's record that needs only the common step count, put into
one SUM round (bit planes counted over the ranks), plus what the later rounds need of it. No collectives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ddp_doctor.core.codes import Code
from ddp_doctor.core.records import CRASH_KINDS, RankRecord
from ddp_doctor.exchange.local import training_loader
from ddp_doctor.exchange.packing import SumRound, bool_digest, of_record, text_digest
from ddp_doctor.exchange.summary import SAVE_BUCKETS

__all__ = ["LocalFacts", "local_facts"]


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


def local_facts(b: SumRound, record: RankRecord, *, s: int, lead: int, pad_steps: int, rank: int) -> LocalFacts:
    """Fill round `b` with this rank's facts over the first `s` steps (`lead`: its leading complete steps; shapes
    padded to `pad_steps`, the longest record) and return what the later rounds need."""
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
