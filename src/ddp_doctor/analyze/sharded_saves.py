"""`sharded-checkpoint-incomplete`, decided here for a run that ended and for one that failed: a sharded model's
state dict saved by some ranks only or by every rank to one path (each file holds the saving ranks' shards), and a
`state_dict()` taken on some ranks only, whose resharding put the ranks' next collectives out of step. Pure: the
agreed facts (`ShardedRun`) or the supervisor's `RankState` per rank in.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_train.py`, 12 steps): rank 0
alone calling `torch.save(model.state_dict(), path)` ends with exit code 0; the file holds DTensors with rank 0's
shard (a [32, 16] local tensor of a [64, 16] weight), and loading it into the unsharded model raises
*aten.copy_.default got mixed torch.Tensor and DTensor*.
"""

from __future__ import annotations

from ddp_doctor.analyze.positions import capped, positions, short, where
from ddp_doctor.analyze.sharded_failures import framework_of, line_alone
from ddp_doctor.analyze.sharded_fixes import save_fix
from ddp_doctor.analyze.view import detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.ranks import rank_list, ranks_label
from ddp_doctor.core.rankstate import RankState
from ddp_doctor.core.sharded_run import ShardedRun

__all__ = ["incomplete_checkpoint", "state_dict_alone"]


@detects(Code.SHARDED_CHECKPOINT_INCOMPLETE, road="sharded")
def incomplete_checkpoint(run: ShardedRun) -> list[Finding]:
    """A `torch.save` of the sharded state dict, in a run that ended: on some ranks only, or on every rank to one
    path (`ShardedRun.shard_save`)."""
    if not run.shard_save:
        return []
    save = run.shard_save
    shards = save.get("shards") or {}
    file, site = save.get("shown", "a file"), save.get("site")
    at = f" at {site}" if site else ""
    local, full = ("x".join(map(str, shards.get(k, []))) for k in ("local", "global"))
    measured = [Measure("sharded_tensors", shards["tensors"], "count")] if shards.get("tensors") else []
    if not run.shard_save_one_path:
        measured.append(Measure("saving_ranks", run.shard_save_ranks, "count"))
    if run.shard_save_one_path:
        title = f"every rank saved its shards of the model to the same file: {file} holds one rank's shards"
        holds = "holds the shards of whichever rank wrote last"
    else:
        savers = f"rank {run.shard_save_first}" if run.shard_save_ranks == 1 else f"{run.shard_save_ranks} ranks"
        holds = f"holds {run.shard_save_ranks} of {run.world} ranks' shards"
        title = f"{savers} alone saved the sharded state dict: {file} {holds}"
    finding = Finding(
        code=Code.SHARDED_CHECKPOINT_INCOMPLETE,
        severity="error",
        title=title,
        detail=f"torch.save{at} wrote a state dict of {shards.get('tensors', 'its')} DTensors: an FSDP2 model's "
        "state_dict() returns each parameter as a DTensor holding this rank's shard only "
        f"({shards.get('example', 'a parameter')} is {local} of {full} in the file). So the file {holds}, "
        "the rest of the model is not in it, and loading it into the unsharded model fails (*aten.copy_.default "
        "got mixed torch.Tensor and DTensor*), typically long after the job ended. Checked: the torch.save calls "
        + (
            "of the observed steps and of the epoch end followed after them."
            if run.followed
            else "of the observed steps."
        ),
        # The ranks that saved, as far as they are known: every rank, or the first of those that did.
        ranks=list(range(run.world)) if run.shard_save_one_path else [run.shard_save_first],
        fix=save_fix(run.framework),
        sites=lines_of(site or ""),
        measured=measured,
        labels={
            **_shard_labels(shards, file, "one-path" if run.shard_save_one_path else "some-ranks"),
            "saves_checked": "observed-steps-and-epoch-end" if run.followed else "observed-steps",
        },
    )
    return [finding]


def _shard_labels(shards: dict, file: str, kind: str) -> dict[str, str]:
    """The file and the example parameter with its shard's and the whole weight's shapes (`"32x16"`), as far as
    the saving rank recorded them."""
    labels = {"kind": kind, "file": file}
    if shards.get("example"):
        labels["example"] = shards["example"]
    for key, name in (("local", "local_shape"), ("global", "global_shape")):
        if shards.get(key):
            labels[name] = "x".join(map(str, shards[key]))
    return labels


def state_dict_alone(states: dict[int, RankState], native: list[str]) -> Finding | None:
    """A line that took the FSDP2 model's `state_dict()` on some ranks and not on others (counted from the first
    optimizer step), in a run that failed: the state dict holds the calling ranks' shards only, and FSDP2 reshards
    there a module a forward left unsharded (after an evaluation, with no backward), so the ranks' next all-gathers
    differ."""
    found = line_alone(states, lambda s: s.state_dicts)
    if found is not None:
        site, alone, rest = found
        went = capped([f"rank {r} was at {where(states[r])}" for r in rest])
        said = f" The communication library said: {native[0]}" if native else ""
        return Finding(
            code=Code.SHARDED_CHECKPOINT_INCOMPLETE,
            severity="error",
            title=f"{rank_list(alone)} alone took the sharded model's state_dict(), at {short(site)}: the ranks' "
            "next collectives differed",
            detail=f"state_dict() at {site} ran on {rank_list(alone)} only, not on {rank_list(rest)}. An FSDP2 model's "
            "state_dict() holds each parameter as a DTensor of the calling rank's shard, so a file saved from it "
            "holds that rank's shards only; and FSDP2 reshards there any module a forward left unsharded (the root "
            "stays unsharded after a forward that no backward follows, an evaluation), on the calling ranks only. "
            "Their next forward all-gathered what the others' did not, and a mismatched collective aborts, hangs or "
            f"exchanges the wrong data: {went}." + said,
            ranks=sorted(states),
            steps=sorted({max(states[r].step, 0) for r in alone}),
            fix=save_fix(framework_of(states)),
            sites=lines_of(site),
            labels={"kind": "state-dict-some-ranks", "ranks_alone": ranks_label(alone)},
            positions=positions(states, [*alone, *rest]),
        )
    return None
