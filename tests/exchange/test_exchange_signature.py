"""The exchange sends the same bytes: every collective's op, shape and each rank's tensor, for a few simulated groups
that take every conditional round (B2, B3, C, ModelInfos that differ, more ranks than example slots), against
signatures recorded before the protocol was cut into rounds; and the same for a sharded job's exchange and for the
epoch end's (`follow_rounds`), a run without a wrapper's (`unwrapped_rounds`) and the control rounds
(`exchange/control.py`). A change here changes what ranks send: re-record only on purpose
(`PYTHONPATH=tests python tests/exchange/test_exchange_signature.py` prints the current ones), and say why in the
commit."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest
import torch
from handbuilt import P, follow_case, model_info, sharded_record

from ddp_doctor.core.fingerprint import fingerprints_batched
from ddp_doctor.core.records import CRASH_KINDS, ModelInfo, RankRecord, StepCounters
from ddp_doctor.exchange import simulate
from ddp_doctor.exchange.control import ROUNDS
from ddp_doctor.exchange.following_rounds import follow_rounds
from ddp_doctor.exchange.sharded_protocol import sharded_protocol
from ddp_doctor.exchange.unwrapped import unwrapped_rounds

STEPS = 4

RECORDED = {
    "seeded-6": "a591fc1c38bcb2d2",
    "odd-70": "65b0764637e774ef",
    "infos-differ-3": "7913e799469a188f",
    "edited-2": "7edfde28b50054b3",
    "inferred-2": "f036ff9bf8a56054",
    "clean-1": "6220116b2d12dd1c",
}


def _rank(rank: int, *, seed: int | None, edited: bool = False, crashed: bool = False) -> RankRecord:
    """Random usage, frozen flags, fingerprints (a few NaN), per-step counters and strings, seeded by `seed`
    (None: a clean rank); `edited`: gradients changed after DDP's all-reduce; `crashed`: a reduction error."""
    used = torch.ones(STEPS, P, dtype=torch.bool)
    ran, trainable = used.clone(), used.clone()
    grad = torch.arange(STEPS * P * 2, dtype=torch.float64).reshape(STEPS, P, 2)
    weight = torch.arange((STEPS + 1) * P * 2, dtype=torch.float64).reshape(STEPS + 1, P, 2)
    timing = torch.full((STEPS, 5), 0.01, dtype=torch.float64)
    c = StepCounters(
        ddp_forwards=1, micro_steps=1, synced_backwards=1, optimizer_step=1, batch_size=8, batchnorm_training=1
    )
    table = torch.tensor([c.as_list()] * STEPS)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        used = torch.rand(STEPS, P, generator=g) < 0.7
        ran = used | (torch.rand(STEPS, P, generator=g) < 0.5)
        trainable = torch.rand(STEPS, P, generator=g) < 0.9
        grad = grad + (torch.rand(STEPS, P, 2, generator=g) < 0.3) * torch.rand(STEPS, P, 2, generator=g)
        weight = weight + (torch.rand(STEPS + 1, P, 2, generator=g) < 0.2) * torch.rand(STEPS + 1, P, 2, generator=g)
        grad[torch.rand(STEPS, P, 2, generator=g) < 0.05] = float("nan")
        timing = torch.rand(STEPS, 5, generator=g, dtype=torch.float64)
        names = ("unpaired_forwards", "collectives", "collective_digest", "optimizer_digest", "scheduler_steps")
        for name in (*names, "batches_drawn"):
            table[:, StepCounters.FIELDS.index(name)] = torch.randint(0, 2, (STEPS,), generator=g)
    synced = None
    if edited:
        synced = grad.clone()
        grad = grad.clone()
        grad[:, 2] *= 0.5
    if crashed:
        table[STEPS - 1, StepCounters.FIELDS.index("complete")] = 0
    return RankRecord(
        rank=rank,
        used=used,
        reachable=used.clone(),
        ran=ran,
        trainable=trainable,
        grad_fp=grad,
        synced_grad_fp=synced,
        weight_fp=weight,
        buffer_fp=torch.zeros(STEPS, 1, 2, dtype=torch.float64),
        input_fp=torch.full((STEPS, 2), float(rank + 1), dtype=torch.float64),
        timing=timing,
        counters=table,
        crash_kind=CRASH_KINDS.index("reduction-error") if crashed else 0,
        crash_step=STEPS - 1 if crashed else -1,
        crash_message=f"Expected to have finished reduction in the prior iteration (rank {rank})" if crashed else "",
        loaders=[{"line": "train.py:20", "batches": 10 + rank % 3, "padded": rank % 2}],
        saves=[{"path": "ckpt.pt" if rank % 2 else f"ckpt{rank}.pt", "line": "train.py:40", "step": 1}],
        repeat_sites=[f"step {s}: train.py:{30 + rank % 2}" for s in range(STEPS)],
    )


def _scenario(name: str) -> tuple[ModelInfo, list[RankRecord], list[ModelInfo] | None]:
    if name == "seeded-6":
        return model_info(), [_rank(r, seed=r, crashed=r == 4) for r in range(6)], None
    if name == "odd-70":
        return model_info(), [_rank(r, seed=r if r in (1, 3, 65, 69) else None) for r in range(70)], None
    if name == "infos-differ-3":
        infos = [model_info(ddp_site=f"train.py:{r}") for r in range(3)]
        return infos[0], [_rank(r, seed=None) for r in range(3)], infos
    if name == "edited-2":
        return model_info(), [_rank(0, seed=None, edited=True), _rank(1, seed=None)], None
    if name == "inferred-2":  # the wrap state is inferred: the unmasked gradient digests travel too
        unfrozen = _rank(1, seed=None)
        unfrozen.grad_fp = unfrozen.grad_fp.clone()
        unfrozen.grad_fp[:, 3] += 1.0
        return (
            replace(model_info(), wrap_state_exact=False, wrap_trainable_count=4),
            [_rank(0, seed=None), unfrozen],
            None,
        )
    return model_info(), [_rank(0, seed=None)], None


def _traced(gen, sent: list):
    """Run `gen` (one rank's rounds), appending (op, dtype, shape, sha256 of the bytes) of each collective to `sent`."""
    reply = None
    while True:
        try:
            op, t = gen.send(reply)
        except StopIteration as stop:
            return stop.value
        sent.append((op, str(t.dtype), tuple(t.shape), hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()))
        reply = yield op, t


def signature(name: str) -> str:
    """sha256 over the sequence of (op, dtype, shape) and every rank's bytes, collective by collective."""
    info, records, infos = _scenario(name)
    sent: list[list[tuple[str, str, tuple[int, ...], str]]] = [[] for _ in records]
    protocol = simulate.protocol

    def traced(record, info, *, rank, world):
        return _traced(protocol(record, info, rank=rank, world=world), sent[rank])

    simulate.protocol = traced
    try:
        simulate.summarize(info, records, infos=infos)
    finally:
        simulate.protocol = protocol
    return hashlib.sha256(json.dumps(sent).encode()).hexdigest()[:16]


SHARDED = {
    "sharded-clean-3": ({}, "6360905b88b6b599"),
    "sharded-mistakes-6": (
        {
            "settings_odd": (2, 5),
            "saver": 4,
            "unsharded_odd": (1,),
            "collectives_odd": (3,),
            "replica_rows": 2,
            "replicas_odd": (5,),
            "own_s": 0.02,
            "sampler_odd": (4,),
            "drawn_odd": (1,),
        },
        "41691f26f62564a0",
    ),
}
"""A sharded job's exchange (FSDP2, `replicate`): each scenario's mistakes (`handbuilt.sharded_record`) and the
signature recorded for it."""


def sharded_signature(name: str) -> str:
    """sha256 over the sequence of (op, dtype, shape) and every rank's bytes of the sharded exchange."""
    mistakes, _ = SHARDED[name]
    world = int(name.rsplit("-", 1)[1])
    sent: list[list] = [[] for _ in range(world)]
    simulate.lockstep(
        [_traced(sharded_protocol(sharded_record(w, **mistakes), rank=w, world=world), sent[w]) for w in range(world)]
    )
    return hashlib.sha256(json.dumps(sent).encode()).hexdigest()[:16]


FOLLOWED = {"follow-alone-6": ("alone", 4, "d27abb860d7bceb9"), "follow-counts-5": ("counts", 2, "afca4ed890509640")}
"""The epoch end's exchange (`follow_rounds`): each scenario's case and odd rank (`handbuilt.follow_case`) and the
signature recorded for it."""


def follow_signature(name: str) -> str:
    """sha256 over the sequence of (op, dtype, shape) and every rank's bytes of the epoch end's exchange."""
    case, odd, _ = FOLLOWED[name]
    world = int(name.rsplit("-", 1)[1])
    sent: list[list] = [[] for _ in range(world)]
    simulate.lockstep(
        [_traced(follow_rounds(follow_case(w, case, odd), rank=w, world=world), sent[w]) for w in range(world)]
    )
    return hashlib.sha256(json.dumps(sent).encode()).hexdigest()[:16]


UNWRAPPED = {"unwrapped-odd-5": "81339489416ca6d6", "unwrapped-extra-3": "4af32c4fb4255cce"}
"""The exchange of a run without a wrapper (`unwrapped_rounds`): rank 1 holds one parameter apart (`odd`) or steps
one more (`extra`); the signature recorded for each."""


def unwrapped_signature(name: str) -> str:
    """sha256 over the sequence of (op, dtype, shape) and every rank's bytes of the unwrapped run's exchange."""
    world = int(name.rsplit("-", 1)[1])
    sent: list[list] = [[] for _ in range(world)]
    ranks = []
    for w in range(world):
        params = [torch.arange(12.0).reshape(3, 4) + (0.5 if w == 1 else 0.0), torch.ones(5)]
        if w == 1 and "extra" in name:
            params.append(torch.ones(1))
        ranks.append(params)
    simulate.lockstep(
        [
            _traced(unwrapped_rounds(len(p), 0, lambda p=p: fingerprints_batched(p)), sent[w])
            for w, p in enumerate(ranks)
        ]
    )
    return hashlib.sha256(json.dumps(sent).encode()).hexdigest()[:16]


CONTROL = {"control-flag-3-of-5": "ed8eec3cbeaae4a5", "control-flags-none-of-4": "a5d565ec95abd3b9"}
"""The control rounds (`control.ROUNDS`, each in turn): rank 3 of 5 sets its flag, or no rank of 4; the signature
recorded for each."""


def control_signature(name: str) -> str:
    """sha256 over the sequence of (op, dtype, shape) and every rank's bytes of each control round, in turn."""
    world = int(name.rsplit("-", 1)[1])
    sent: list[list] = [[] for _ in range(world)]
    for rounds in ROUNDS.values():
        simulate.lockstep([_traced(rounds("3-of" in name and w == 3), sent[w]) for w in range(world)])
    return hashlib.sha256(json.dumps(sent).encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", list(CONTROL))
def test_every_rank_of_a_control_round_sends_the_recorded_bytes(name: str) -> None:
    assert control_signature(name) == CONTROL[name]


@pytest.mark.parametrize("name", list(RECORDED))
def test_every_rank_sends_the_recorded_bytes(name: str) -> None:
    assert signature(name) == RECORDED[name]


@pytest.mark.parametrize("name", list(SHARDED))
def test_every_rank_of_a_sharded_job_sends_the_recorded_bytes(name: str) -> None:
    assert sharded_signature(name) == SHARDED[name][1]


@pytest.mark.parametrize("name", list(FOLLOWED))
def test_every_rank_of_the_epoch_ends_exchange_sends_the_recorded_bytes(name: str) -> None:
    assert follow_signature(name) == FOLLOWED[name][2]


@pytest.mark.parametrize("name", list(UNWRAPPED))
def test_every_rank_of_an_unwrapped_run_sends_the_recorded_bytes(name: str) -> None:
    assert unwrapped_signature(name) == UNWRAPPED[name]


if __name__ == "__main__":
    print({name: signature(name) for name in RECORDED})
    print({name: sharded_signature(name) for name in SHARDED})
    print({name: follow_signature(name) for name in FOLLOWED})
    print({name: unwrapped_signature(name) for name in UNWRAPPED})
    print({name: control_signature(name) for name in CONTROL})
