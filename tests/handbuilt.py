"""The small models the exchange's tests build records for by hand. DDP's: five parameters (the last ignored by DDP)
and a BatchNorm buffer, so every round of the exchange has something to carry. A sharded job's (`sharded_record`):
six parameters, two of them outside every sharded group, and three buffers."""

from __future__ import annotations

import torch

from ddp_doctor.core.beside import BesideGroup
from ddp_doctor.core.following import FollowRecord, LoaderSeen, SyncPoint
from ddp_doctor.core.records import ModelInfo
from ddp_doctor.core.sharded_run import INPUT_STEPS
from ddp_doctor.exchange.sharded_protocol import NOBODY, SLOTS, STEP_COLUMNS, STEP_SHIFT, ShardedRecord

NAMES = ["trunk.weight", "trunk.bias", "head_a.weight", "head_b.weight", "norm.weight"]
P = len(NAMES)


def model_info(**overrides) -> ModelInfo:
    """The model as DDP wrapped it, with `overrides` of any `ModelInfo` field."""
    base = {
        "param_names": NAMES,
        "param_shapes": [(4, 3), (4,), (2, 4), (2, 4), (4,)],
        "trainable_at_wrap": [True] * P,
        "ignored": [False] * (P - 1) + [True],
        "buffer_names": ["norm.running_mean"],
        "buffer_shapes": [(4,)],
        "ddp_config": {"find_unused_parameters": True, "static_graph": False, "broadcast_buffers": True},
        "batchnorm": ["norm"],
    }
    base.update(overrides)
    return ModelInfo(**base)


PARAMS, UNSHARDED, BUFFERS, STEPS = 6, 2, 3, 8
REPLICAS_PART_AT = 5
"""The observed step from which the odd replicas differ (`sharded_record`)."""


def sharded_record(
    rank: int,
    *,
    settings_odd: tuple[int, ...] = (),
    saver: int | None = None,
    unsharded_odd: tuple[int, ...] = (),
    collectives_odd: tuple[int, ...] = (),
    replica_rows: int = 0,
    replicas_odd: tuple[int, ...] = (),
    own_s: float = 0.010,
    sampler_odd: tuple[int, ...] = (),
    drawn_odd: tuple[int, ...] = (),
    tp: int = 0,
    tp_odd: tuple[int, ...] = (),
    world: int = 0,
    nonfinite_odd: tuple[int, ...] = (),
) -> ShardedRecord:
    """A rank of a sharded job with 6 parameters (2 outside every sharded group) and 3 buffers, 8 observed steps:
    the ranks in `settings_odd` hold other optimizer settings from step 2 on, `saver` alone saves shards, the
    ranks in `unsharded_odd` hold another copy of the first unsharded parameter, the ranks in `collectives_odd`
    reduce their step's one collective with MAX from step 3 on (the others with the default SUM), each rank reads its
    own batches; with `replica_rows` the parameters are replicated over that many rows (rank % rows), and the ranks
    in `replicas_odd` hold another copy of parameter 3 from step `REPLICAS_PART_AT` on; the training loader's
    DistributedSampler is seeded 0, 7 on the ranks in `sampler_odd`; each step draws one batch from it, two at step
    1 on the ranks in `drawn_odd`. With `tp`, the `world`'s groups of `tp` consecutive ranks beside the data-parallel mesh (tensor
    parallelism) each read one batch per step, the ranks in `tp_odd` another one from step 2 on. The ranks in
    `nonfinite_odd` read one input tensor holding NaN at step 4."""
    slots: dict[str, float] = dict.fromkeys(SLOTS, 0.0)
    saved = rank == saver
    slots.update(
        unsharded=UNSHARDED,
        buffers=BUFFERS,
        changed=1,
        saved=saved,
        saver=rank if saved else NOBODY,
        path=1234 if saved else -1,
        grad_steps=STEPS,
        params=PARAMS,
        gathers=4,
        collectives=STEPS,
        replica_rows=replica_rows,
        timed_steps=STEPS,
        comm_timed=1,
        own_s=own_s,
        sampler=7.0 if rank in sampler_odd else 3.0,
        sampler_has=1,
        beside_groups=world // tp if tp else 0,
        inputs_nonfinite=4 * STEP_SHIFT + rank if rank in nonfinite_odd else NOBODY,
    )
    loader = {
        "sampler": "DistributedSampler",
        "seed": 7 if rank in sampler_odd else 0,
        "rank": rank,
        "epoch": 0,
        "site": "train.py:30",
    }
    grads = torch.ones(PARAMS, 3)
    grads[5] = 0.0  # the last parameter never gets a gradient
    unsharded = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    if rank in unsharded_odd:
        unsharded[0, 1] += 0.5
    steps = torch.zeros(INPUT_STEPS, STEP_COLUMNS, dtype=torch.float64)
    held = []
    for k in range(STEPS):
        apart = rank in settings_odd and k >= 2
        calls = rank in collectives_odd and k >= 3
        digest = 77.0 if calls else 3.0
        drawn = 2.0 if rank in drawn_odd and k == 1 else 1.0
        batch = (rank // tp + k + (0.5 if rank in tp_odd and k >= 2 else 0.0)) if tp else rank + k
        measures = [batch, 1.0, 1.0, 1.0, 1.0, 4.0, 0.0, 1.0, 99.0 if apart else 7.0, 5.0, 1.0, digest, drawn]
        steps[k] = torch.tensor(measures)
        shown = ["all_reduce(float32[1], MAX)/4 at train.py:60" if calls else "all_reduce(float32[1])/4 at train.py:60"]
        held.append((99.0 if apart else 7.0, f"lr={0.5 if apart else 0.1}", 5.0, "model: train", digest, shown))
    replicas = replica_steps = None
    if replica_rows:
        row = rank % replica_rows
        replicas = torch.arange(PARAMS * 4, dtype=torch.float64).reshape(PARAMS, 4) + 100.0 * row
        replica_steps = torch.zeros(INPUT_STEPS, 2, dtype=torch.float64)
        replica_steps[:STEPS, 0] = torch.arange(STEPS, dtype=torch.float64) + 1000.0 * row
        replica_steps[:STEPS, 1] = 1.0
        if rank in replicas_odd:
            replicas[3, 3] += 0.5
            replica_steps[REPLICAS_PART_AT:STEPS, 0] += 0.5
    return ShardedRecord(
        slots=slots,
        replicas=replicas,
        replica_steps=replica_steps,
        replica_row=rank % replica_rows if replica_rows else 0,
        grads=grads,
        unsharded=unsharded,
        buffers=torch.zeros(BUFFERS, 3, dtype=torch.float64),
        steps=steps,
        held=held,
        saved={"shown": "model.state_dict()", "site": "train.py:40", "shards": [4, 8]} if saved else None,
        clock={"own_s": own_s, "own_q1_s": own_s, "own_q3_s": own_s, "wait_s": 0.001, "comm_s": 0.002},
        loader=loader,
        beside=_beside(rank, tp, world) if tp else None,
    )


def _beside(rank: int, tp: int, world: int) -> BesideGroup:
    members = [list(range(g * tp, g * tp + tp)) for g in range(world // tp)]
    return BesideGroup(rank=rank, index=rank // tp, members=members, dims=["tp"])


# ---------------------------------------------------------------- epoch following (`following_rounds.py`)


def follow_sync(kind: str, at: float, site: str = "train.py:20") -> SyncPoint:
    return SyncPoint(kind=kind, what="DDP's gradient all-reduce after the forward", site=site, enter=at, exit=at + 0.01)


def follow_record(rank: int, *, alone: bool, loaders: list[LoaderSeen] | None = None, extra: int = 0) -> FollowRecord:
    """Two sync points; on a rank `alone`, an evaluation pass of 2 of 400 batches (0.5 s) before the second."""
    passes = (
        [{"site": "train.py:40", "started": 10.1, "ended": 10.6, "yielded": 2, "capped": True, "batches": 400}]
        if alone
        else []
    )
    second = 10.7 if alone else 10.15
    syncs = [
        follow_sync("ddp-step", 10.05),
        *[follow_sync("collective", 10.06 + i * 0.001) for i in range(extra)],
        follow_sync("ddp-step", second),
    ]
    return FollowRecord(
        requested=1,
        limit=2,
        followed=True,
        epoch_ends=1,
        ended_by="the next epoch's first step, after 1 epoch end(s)",
        seconds=0.7,
        syncs=syncs,
        counts={"ddp-step": 2, **({"collective": extra} if extra else {})},
        passes=passes,
        loaders=loaders or [],
        timeout_s=60.0,
        started_at=10.0,
    )


def follow_case(rank: int, case: str, odd: int) -> FollowRecord:
    """Rank `odd` evaluated alone on a loader of its own ("alone") or issued one collective more ("counts");
    each rank's training loader has 30 + rank batches."""
    train = LoaderSeen(
        key="train.py:10|DistributedSampler|True",
        site="train.py:10",
        batches=30 + rank,
        passes=2,
        most=8,
        capped=1,
        training=True,
        sampler="DistributedSampler",
    )
    evaluation = LoaderSeen(
        key="train.py:40|SequentialSampler|None",
        site="train.py:40",
        batches=400,
        passes=1,
        most=2,
        capped=1,
        sampler="SequentialSampler",
    )
    if case == "alone":
        return follow_record(rank, alone=rank == odd, loaders=[train, evaluation] if rank == odd else [train])
    return follow_record(rank, alone=False, loaders=[train], extra=int(rank == odd))
