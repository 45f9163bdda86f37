"""The sharded model's exchange (FSDP2, `replicate`: `exchange/sharded_protocol.py`) run for every rank at once by
the in-process model (`simulate.lockstep`) up to 1,024 ranks, and over a real 4-rank gloo group: the same answers
both ways, the ranks that differ named whatever the world size, and a volume per rank that does not grow with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist import run_ranks
from handbuilt import BUFFERS, REPLICAS_PART_AT, STEPS, sharded_record

from ddp_doctor.core.agreed import HeldApart
from ddp_doctor.exchange.sharded_protocol import STEP_SHIFT, sharded_protocol
from ddp_doctor.exchange.simulate import lockstep


def simulated(world: int, **mistakes: Any) -> tuple[Any, Any]:
    if "tp" in mistakes:
        mistakes["world"] = world
    return lockstep([sharded_protocol(sharded_record(w, **mistakes), rank=w, world=world) for w in range(world)])


def test_a_clean_jobs_exchange_costs_each_rank_the_same_from_2_to_1024_ranks() -> None:
    volumes = {}
    for world in (2, 64, 1024):
        got, volume = simulated(world)
        assert got.grads is not None and got.grads[:, 0].tolist() == [1.0] * 5 + [0.0]
        assert got.unsharded_differ == [False, False] and got.buffers_differ == [False] * BUFFERS
        assert got.per_step["inputs_compared"] == list(range(STEPS)) and not got.per_step["inputs_identical"]
        assert got.per_step["settings_apart"] is None and got.shard_save == {} and got.slowest is None
        assert got.per_step["collectives_apart"] is None and got.top["collectives"] == got.low["collectives"] == STEPS
        assert got.samplers is None and got.per_step["drawn_apart"] is None
        volumes[world] = (volume.sent, volume.collectives)
    assert volumes[2] == volumes[64] == volumes[1024], volumes
    assert volumes[1024][0] < 4096  # per rank: the slots, gradient flags, fingerprints and the 16-step table


def test_ranks_apart_are_named_at_1024_ranks_in_the_volume_of_64() -> None:
    mistakes = {
        "settings_odd": (3, 700),
        "saver": 5,
        "unsharded_odd": (1000,),
        "collectives_odd": (9, 10, 1023),
        "sampler_odd": (2, 999),
        "drawn_odd": (6, 1001),
        "nonfinite_odd": (900, 601),
    }
    got, big = simulated(1024, **mistakes)
    assert divmod(int(got.low["inputs_nonfinite"]), STEP_SHIFT) == (4, 601)  # the step, the lowest such rank
    apart = got.per_step["settings_apart"]
    assert apart == HeldApart(step=2, reference=0, held={0: "lr=0.1", 3: "lr=0.5"}, ranks=[3, 700], more=0)
    assert got.per_step["modes_apart"] is None
    assert got.per_step["collectives_apart"] == HeldApart(
        step=3,
        reference=0,
        held={0: ["all_reduce(float32[1])/4 at train.py:60"], 9: ["all_reduce(float32[1], MAX)/4 at train.py:60"]},
        ranks=[9, 10, 1023],
    )
    assert got.samplers == {
        "held": {
            0: {"sampler": "DistributedSampler", "seed": 0, "rank": 0, "epoch": 0, "site": "train.py:30"},
            2: {"sampler": "DistributedSampler", "seed": 7, "rank": 2, "epoch": 0, "site": "train.py:30"},
        },
        "ranks": [2, 999],
        "more": 0,
    }
    assert got.per_step["drawn_apart"] == HeldApart(
        step=1, reference=0, held={0: (1, "train.py:30"), 6: (2, "train.py:30")}, ranks=[6, 1001]
    )
    assert got.unsharded_differ == [True, False] and got.unsharded_gap == pytest.approx(0.5)
    assert got.shard_save == {
        "shard_save": {"shown": "model.state_dict()", "site": "train.py:40", "shards": [4, 8]},
        "shard_save_ranks": 1,
        "shard_save_first": 5,
        "shard_save_one_path": False,
    }
    _, small = simulated(
        64,
        settings_odd=(3, 60),
        saver=5,
        unsharded_odd=(63,),
        collectives_odd=(9, 10, 63),
        sampler_odd=(2, 63),
        drawn_odd=(6, 63),
    )
    assert (big.sent, big.collectives) == (small.sent, small.collectives)


@pytest.mark.parametrize(
    ("world", "tp", "odd", "groups", "exact"),
    [
        (1024, 2, (), [], True),  # every tensor-parallel pair reads one batch: nothing apart
        (4, 2, (3,), [[2, 3]], True),
        (
            128,
            16,
            (17, 100),
            [[16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31], list(range(96, 112))],
            True,
        ),
        (1024, 2, (5, 800), [], False),  # 512 groups in 64 slots: slots 2 and 16 (400 % 64), no group named
    ],
)
def test_inputs_within_tensor_parallel_groups_are_compared_in_a_fixed_volume(
    world: int, tp: int, odd: tuple[int, ...], groups: list[list[int]], exact: bool
) -> None:
    """FSDP2 over tensor parallelism: the groups of `tp` ranks beside the data-parallel mesh must read one batch;
    the ranks in `odd` read another from step 2 on. One SUM when they agree, two when not, at any world size."""
    got, volume = simulated(world, tp=tp, tp_odd=odd)
    assert got.beside["beside_compared"] == list(range(STEPS)) and got.beside["beside_groups"] == world // tp
    if not odd:
        assert got.beside["beside_apart"] is None
        return
    apart = got.beside["beside_apart"]
    assert (apart["step"], apart["steps"], apart["groups"], apart["exact"]) == (2, list(range(2, STEPS)), groups, exact)
    assert apart["count"] == len(odd) and apart["slots"] == [r // tp % 64 for r in odd] and apart["dims"] == ["tp"]
    _, clean = simulated(world, tp=tp)
    assert volume.collectives == clean.collectives + 1
    assert volume.sent - clean.sent == 64 * 2 * 8  # the slots' round: 64 groups' two hashes, float64


@pytest.mark.parametrize(
    ("rows", "odd", "reference", "named"),
    [
        (1, (5, 600), 0, [5, 600]),  # replicate: every rank holds the whole; the most common copy is the reference
        (8, (13,), 5, [13]),  # HSDP, 8 shards: ranks 5, 13, 21, ... hold shard 5; the lowest holds the reference
    ],
)
def test_replicas_apart_are_named_at_1024_ranks_in_the_volume_of_64(
    rows: int, odd: tuple[int, ...], reference: int, named: list[int]
) -> None:
    got, big = simulated(1024, replica_rows=rows, replicas_odd=odd)
    assert got.replicas["replicas_apart"] == {
        "at_first": False,
        "first_step": REPLICAS_PART_AT,
        "row": odd[0] % rows,
        "params": [3],
        "reference": reference,
        "ranks": named,
        "more": 0,
    }
    _, small = simulated(64, replica_rows=rows, replicas_odd=tuple(r % 64 for r in odd))
    assert (big.sent, big.collectives) == (small.sent, small.collectives)
    clean, _ = simulated(1024, replica_rows=rows)
    assert clean.replicas == {"replica_rows": rows, "replicas_compared": 6}


def test_the_slowest_rank_is_named_among_1024() -> None:
    world = 1024
    gens = [
        sharded_protocol(sharded_record(w, own_s=0.050 if w == 777 else 0.010), rank=w, world=world)
        for w in range(world)
    ]
    got, _ = lockstep(gens)
    assert got.slowest is not None
    assert (got.slowest["rank"], got.slowest["steps"]) == (777, STEPS)
    assert got.slowest["own_s"] == pytest.approx(0.050) and got.slowest["others_own_s"] == pytest.approx(0.010)


def _real(rank: int, world: int, mistakes: dict[str, Any]) -> Any:
    from ddp_doctor.exchange.drive import drive

    got = drive(
        sharded_protocol(sharded_record(rank, **mistakes), rank=rank, world=world),
        group=None,
        device=torch.device("cpu"),
    )
    return {k: getattr(got, k) for k in got.__slots__ if k != "grads"}, got.grads.tolist()


def test_a_real_gloo_group_reads_back_what_the_model_computes(tmp_path: Path) -> None:
    mistakes = {
        "settings_odd": (2,),
        "saver": 3,
        "unsharded_odd": (1,),
        "collectives_odd": (3,),
        "replica_rows": 2,
        "replicas_odd": (3,),
    }
    real = run_ranks(_real, tmp_path, world_size=4, args=(mistakes,), timeout=120)
    model, _ = simulated(4, **mistakes)
    expected = ({k: getattr(model, k) for k in model.__slots__ if k != "grads"}, model.grads.tolist())
    assert all(r == expected for r in real), (real[0], expected)
    assert expected[0]["per_step"]["settings_apart"].ranks == [2]
    assert expected[0]["per_step"]["collectives_apart"].ranks == [3]
    assert expected[0]["replicas"]["replicas_apart"]["ranks"] == [3]  # against rank 1, which holds shard 1 too
