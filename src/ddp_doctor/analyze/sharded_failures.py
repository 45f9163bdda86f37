"""Findings of a failed FSDP2 job that name a collective some ranks entered alone: a full state dict gathered on
some ranks only (`state-gather-some-ranks`), a forward through the sharded model run on some ranks only
(`sharded-forward-some-ranks`); and FSDP2's error for parameters left on the meta device, in the words of the
modules that hold them. Pure: the supervisor's `RankState` per rank in.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_train.py`): a full state dict
gathered on rank 0 alone meets rank 1's next forward, and gloo aborts rank 1 (*Received data size doesn't match
expected size*); an evaluation forward under `no_grad` on rank 0 alone returns (its all-gathers took rank 1's
training forward's, of the same sizes), and both ranks then hang until the job is killed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ddp_doctor.analyze.causes import sharded_step_skipped
from ddp_doctor.analyze.positions import capped, positions, short, where
from ddp_doctor.analyze.sharded_fixes import gather_fix
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.ranks import rank_list, ranks_label
from ddp_doctor.core.rankstate import RankState

__all__ = [
    "explain_fsdp2_crash",
    "explain_meta_params",
    "forward_alone",
    "gather_alone",
    "framework_of",
    "line_alone",
    "step_skipped_alone",
]

_ON_META = re.compile(r"materialized from meta device before training.*still on meta device: \[([^\]]*)\]", re.S)

_DTYPES_MIXED = re.compile(r"same dtype|scalar type|Input type|dtype mismatch", re.I)
_LOW_NAMES = {"bfloat16": ("BFloat16", "bfloat16"), "float16": ("Half", "float16")}

_GATHERS = ("get_model_state_dict", "get_state_dict", "get_optimizer_state_dict", "full_tensor", "_gather_state_dict")
"""The calls that all-gather sharded (DTensor) state, the one a user calls first: every rank must enter them."""


def framework_of(states: dict[int, RankState]) -> str:
    """The training framework that stepped the sharded model's optimizer (`torch` when none did)."""
    return next((s.framework for s in states.values() if s.framework), "torch")


def _gather(s: RankState) -> tuple[str, str | None] | None:
    """(the call, its line) of the gather of sharded state the rank was in when the run failed, where no rank counted
    one (a gather before the first optimizer step): from its traceback, its fault dump or the watchdog's last sample
    of its innermost frame, which can be stale by a second or more on a loaded machine."""
    texts = [s.raised.traceback if s.raised else "", s.innermost or ""]
    texts += [fn for _, _, fn in (s.fault.frames if s.fault else [])]
    call = next((g for g in _GATHERS if any(re.search(rf"\b{g}\b", t) for t in texts)), None)
    return None if call is None else (call, (s.raised.site if s.raised else None) or s.site or s.user_frame)


def line_alone(
    states: dict[int, RankState], counted: Callable[[RankState], dict[str, int]]
) -> tuple[str, list[int], list[int]] | None:
    """The first line (in order) that some ranks following the sharded model counted and the others never did:
    (the line, those ranks, the others). `launch/plain_steps.py` counts forwards, `state_dict()` calls and gathers
    by line once the model has stepped, before their collectives start."""
    ranks = {r: s for r, s in states.items() if s.sharded}
    for line in sorted({k for s in ranks.values() for k in counted(s)}):
        alone = sorted(r for r, s in ranks.items() if counted(s).get(line))
        if len(alone) < len(ranks):
            return line, alone, sorted(r for r in ranks if r not in alone)
    return None


def _counted_alone(states: dict[int, RankState]) -> dict[int, tuple[str, str | None]]:
    """rank -> (call, line) of the first gather line it counted that some other rank never counted."""
    found = line_alone(states, lambda s: s.gathers)
    if found is None:
        return {}
    call, _, site = found[0].partition(" at ")
    return dict.fromkeys(found[1], (call, site))


def gather_alone(states: dict[int, RankState], native: list[str]) -> Finding | None:
    """Some ranks gathered a full state dict of sharded parameters (`get_model_state_dict(...,
    full_state_dict=True)`, `DTensor.full_tensor()`) while the others did not: their all-gathers met the others'
    next collectives (the forward's all-gathers of the sharded parameters)."""
    gathering = _counted_alone(states) or {r: g for r, s in states.items() if (g := _gather(s)) is not None}
    if not gathering or len(gathering) == len(states):
        return None
    first = min(gathering)
    call, site = gathering[first]
    rest = sorted(r for r in states if r not in gathering)
    labels = {"call": call, "site": site or "", "ranks_alone": ranks_label(sorted(gathering))}
    if native:
        labels["native"] = native[0]
    return Finding(
        code=Code.STATE_GATHER_SOME_RANKS,
        severity="error",
        ranks=sorted(states),
        steps=sorted({max(states[r].raised.step if states[r].raised else states[r].step, 0) for r in gathering}),
        sites=lines_of(site or ""),
        labels=labels,
        positions=[*positions(states, sorted(gathering)), *positions(states, rest)],
        fix=gather_fix(framework_of(states)),
    )


def forward_alone(states: dict[int, RankState]) -> Finding | None:
    """A line that ran forwards through the FSDP2 model on some ranks and none on others (counted from the first
    optimizer step): each such forward all-gathers the sharded parameters, a collective the others never enter."""
    found = line_alone(states, lambda s: s.forwards)
    if found is not None:
        site, alone, rest = found
        counts = {r: states[r].forwards[site] for r in alone}
        went = capped([f"rank {r} was at {where(states[r])}" for r in rest])
        # the step each rank first ran it in, and whether in grad mode (a training pass: a backward follows)
        firsts = {r: states[r].forward_first.get(site) or [max(states[r].step, 0), False] for r in alone}
        training = any(grad for _, grad in firsts.values())
        return Finding(
            code=Code.SHARDED_FORWARD_SOME_RANKS,
            severity="error",
            title=f"{rank_list(alone)} ran a {'training pass' if training else 'forward'} through the sharded model "
            f"that {rank_list(rest)} did not: {short(site)}",
            detail=f"The forward at {site} ran on {rank_list(alone)} only ("
            + ", ".join(f"{counts[r]} time{'s' if counts[r] != 1 else ''} on rank {r}" for r in alone)
            + f", none on {rank_list(rest)}, counted from the first optimizer step"
            + (", in grad mode: a training pass, whose backward reduce-scatters gradients too" if training else "")
            + "). FSDP2's forward all-gathers the parameters of every sharded module, a collective each rank must "
            f"enter, so its all-gathers were paired with the other ranks' next collectives: {went}. A mismatched "
            "collective aborts, hangs or exchanges the wrong data"
            + (
                "."
                if training
                else " (with gloo here, an evaluation on rank 0 alone returned, computed with the other ranks' "
                "all-gathers, and both ranks hung a step later)."
            ),
            sites=lines_of(site),
            ranks=sorted(states),
            steps=sorted({step for step, _ in firsts.values()}),
            labels={"kind": "training" if training else "forward", "ranks_alone": ranks_label(alone)},
            measured=[Measure("forwards_alone", sum(counts.values()), "count")],
            positions=positions(states, [*alone, *rest]),
            fix="run the same training passes on every rank: an extra objective's forward and backward on every "
            "rank, each on its own data (a zero-weighted loss where a rank has nothing for it), never under a "
            "condition one rank decides alone."
            if training
            else "run the forward on every rank: evaluate on every rank, each on its part of the data, and reduce "
            "the metric (`dist.all_reduce`); or, for a model that rank 0 alone must run (generation, a sample), "
            "gather a full state dict on every rank (`get_model_state_dict(model, options=StateDictOptions("
            "full_state_dict=True, cpu_offload=True))`) and load it into an unsharded copy on rank 0.",
        )
    return None


def step_skipped_alone(states: dict[int, RankState]) -> Finding | None:
    """Some ranks of a sharded model took fewer optimizer steps than others while running more forwards through it
    (the model's collectives, FSDP2's all-gathers or `replicate`'s gradient all-reduce, keep the ranks' iterations in
    lockstep): they skipped `optimizer.step()` in some iteration, and the rank with the most steps reached the
    check's count first. Only when no rank crashed of its own and every
    rank followed the sharded model (`causes.sharded_step_skipped` says the rest).

    Ground truth, plain torchrun, torch 2.13.0, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py --mistake
    skip-rank1`: rank 1 alone skips the third step): exit 0, nothing said; head.weight (its full tensor) sums to
    -1.745120 where every rank stepping gives -1.496532. Under the check, rank 0 reaches the 8th step and waits in
    the report while rank 1, at its 7th, waits in its next forward's all-gather. With `replicate`
    (`tests/scripts/replicate_train.py --mistake skip-rank1`): exit 0, nothing said, and the replicas differ
    (head.weight -1.458571 on rank 0, -1.529048 on rank 1; -1.496532 on both when every rank steps); under the check
    rank 1 waits in its next backward's all-reduce, which the failure report took for a collective rank 0 skipped."""
    # A rank that lost its peer (the others left the run) is no cause of its own.
    ranks = {r: s for r, s in states.items() if s.sharded and (s.raised is None or s.raised.peer_lost)}
    if len(ranks) < 2 or len(ranks) < len(states):
        return None
    most = max(s.step for s in ranks.values())
    ran = {r: sum(s.forwards.values()) for r, s in ranks.items()}
    first = min((r for r, s in ranks.items() if s.step == most), key=lambda r: (-ran[r], r))
    skipped = {r: (s.step, ran[r]) for r, s in ranks.items() if 0 < s.step < most and ran[r] > ran[first]}
    if not skipped:
        return None
    api = next((s.sharding or {}).get("api", "fully_shard") for s in ranks.values())
    return sharded_step_skipped(skipped, (first, most, ran[first]), ranks=sorted(states), api=api)


def explain_meta_params(message: str) -> str | None:
    """FSDP2's error for parameters left on the meta device (built under `torch.device("meta")`, sharded, never
    materialized), in the words of the modules that hold them; None for any other error."""
    match = _ON_META.search(message)
    if match is None:
        return None
    params = [p.strip().strip("'\"") for p in match.group(1).split(",") if p.strip()]
    modules = sorted({p.rpartition(".")[0] or "the root" for p in params})
    shown = ", ".join(params[:6]) + (f" and {len(params) - 6} more" if len(params) > 6 else "")
    return (
        f"fully_shard sharded parameters that are still on the meta device, never materialized or initialised: "
        f"{shown} (module{'s' if len(modules) > 1 else ''} {', '.join(repr(m) for m in modules[:6])}). Materialize "
        "them after the fully_shard calls and before the first forward: `model.to_empty(device=device)`, then "
        "initialise every module (`module.reset_parameters()`, or load a checkpoint into the sharded model)."
    )


def explain_fsdp2_crash(kind: str, message: str, shard: dict[str, Any]) -> str:
    """A script's error before its first optimizer step in an FSDP2 job (`shard`: its `fully_shard` calls, from
    the beacon), in FSDP2's words where it is one: a forward that mixes the dtype a mixed-precision policy runs its
    modules in with float32 (the policy's inputs left uncast, or a module outside every sharded group getting the
    low-precision activations). Ground truth in tests/fsdp2/test_check_fsdp2_dtype.py."""
    calls = shard.get("calls", 0)
    first = f"an FSDP2 job ({calls} fully_shard call{'s' if calls != 1 else ''}, the first at {shard.get('site')})"
    policy = shard.get("policy") or {}
    low = policy.get("param_dtype")
    if not (low in _LOW_NAMES and _DTYPES_MIXED.search(message) and any(n in message for n in _LOW_NAMES[low])):
        return f"{first}: {kind}: {message}"
    given = f"MixedPrecisionPolicy(param_dtype=torch.{low}) given to fully_shard at {policy.get('site')}"
    if not policy.get("cast_forward_inputs", True):
        return (
            f"{first}: the forward mixed float32 and {low} tensors ({kind}: {message}). The {given} runs the module "
            f"it shards in {low} with cast_forward_inputs=False, so its float32 inputs reach {low} weights uncast. Fix: leave "
            f"cast_forward_inputs at its default (True), which casts the module's floating-point inputs to {low}, or "
            f"pass them in {low} yourself (`x.to(torch.{low})`)."
        )
    return (
        f"{first}: the forward mixed float32 and {low} tensors ({kind}: {message}). The {given} runs its modules in "
        f"{low} and casts their inputs; a module outside every fully_shard group keeps float32 weights and gets "
        f"their {low} outputs (the root not sharded, say). Fix: shard that module too (fully_shard(model) on the "
        f"root last, which runs everything left in {low}), or give the policy output_dtype=torch.float32 so the "
        "sharded modules hand float32 on."
    )
