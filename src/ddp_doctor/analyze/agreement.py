"""Detectors of ranks that stop agreeing: a bypassed wrapper, gradients that differ across ranks at the optimizer
step, and every rank training on the same batch (the replicas' weights, modes and buffers: `replica_state.py`). Pure functions of the `View`: the
differences come from the exchange's digests, the ranks from its bounded examples."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.common import steps_of, with_evidence, with_more
from ddp_doctor.analyze.links import UNSYNCED
from ddp_doctor.analyze.local_sgd import local_sgd
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.sharded_run import ShardedRun

__all__ = [
    "beside_inputs_apart",
    "grads_not_synced",
    "identical_inputs",
    "tp_inputs_sharded",
    "unsynced_steps",
    "wrapper_bypass",
]


@detects(Code.WRAPPER_BYPASS)
def wrapper_bypass(v: View) -> list[Finding]:
    # A step with DDP's forward as well is not a bypass: DDP then reduces every gradient, including those of
    # modules called outside its forward (that case is used-outside-forward).
    hits = v.ranks("bypass")
    if not hits.count:
        return []
    sites = v.bypass_sites
    where = f" Called from {', '.join(sites)}." if sites else ""
    return [
        with_more(
            with_evidence(
                rules.wrapper_bypass(
                    title="the wrapped module is called directly, so DDP never synchronizes it",
                    detail="The module inside DDP ran forward in grad mode without DDP's forward around it (for example "
                    "loss = ddp_model.module(x) or a helper that unwraps the model). DDP's reducer only fires after its "
                    "own forward, so each rank trains its own replica." + where,
                    params=v.params(v.summary.bypass_used),
                    ranks=hits.ranks,
                    steps=steps_of(v.summary.bypass_steps),
                    fix="call the DDP wrapper (ddp_model(x)); if the loss needs other outputs, return them from forward. "
                    "ddp_doctor.sync_gradients is the fallback when that is impossible.",
                ),
                sites=sites,
            ),
            hits.more,
        )
    ]


def unsynced_steps(v: View, steps: list[int]) -> bool:
    """Every one of `steps` was an optimizer step on every rank, and no rank's backward in it was synced by DDP
    (every micro-batch ran under `no_sync()` or with `require_backward_grad_sync=False`)."""
    (synced_hi, _), (_, stepped_lo) = v.summary.synced, v.summary.steps_taken
    return bool(steps) and all(synced_hi[k] == 0 and stepped_lo[k] > 0 for k in steps)


@detects(Code.GRADS_NOT_SYNCED, reads_found=True)
def grads_not_synced(v: View, found: frozenset[str]) -> list[Finding]:
    if v.world < 2 or not v.steps or v.crashed_before_first_step:
        return []  # no optimizer used them; reduction-error says the reduction never finished
    # Differ at the optimizer step where every rank trains them; those that agreed after DDP's all-reduce are
    # grads-changed-after-sync's.
    params = v.summary.grad_params & ~v.summary.edited_params
    if not params.any():
        return []
    steps = steps_of(v.summary.grad_steps)
    others = v.ranks("grad-differs")  # ranks whose gradients differ from rank 0's
    ranks = [0] + others.ranks
    sites: list[str] = []  # the lines the cause names: the comm hook's, or where DDP's sync was turned off
    labels: dict[str, str] = {}  # the mechanism, where one was seen
    fix = (
        "see the findings that explain why (a bypassed wrapper, parameters unused with default flags, "
        "requires_grad changed after wrap); gradients must be reduced by DDP before optimizer.step()."
        if found.intersection(UNSYNCED)
        else "gradients must be reduced by DDP before optimizer.step(): check that every rank runs the backward "
        "pass through the DDP model (not its .module), with the same parameters trainable, and that nothing edits "
        ".grad between backward and the optimizer step."
    )
    local = local_sgd(v)
    if local is not None and local.explains(steps) and not found.intersection(UNSYNCED):
        labels = {"kind": "local-sgd"}
        if local.subgroup:
            labels["subgroup_size"] = str(local.subgroup)
        return [
            Finding(
                code=Code.GRADS_NOT_SYNCED,
                severity="info",
                params=v.params(params),
                ranks=ranks,
                steps=steps,
                more_ranks=others.more,
                measured=[*local.measured[:1], Measure("start_localSGD_iter", local.from_iteration, "count")],
                labels=labels,
            )
        ]
    hook = v.meta(0).get("comm_hook")
    if hook and not found.intersection(UNSYNCED) and not unsynced_steps(v, steps):
        sites = [hook["site"]] if hook.get("site") else []
        labels = {"kind": "comm-hook", "hook": hook["name"]}
        fix = (
            f"make {hook['name']} all-reduce each bucket and divide by the world size before returning it, as "
            "torch's allreduce_hook does (torch.distributed.algorithms.ddp_comm_hooks.default_hooks): "
            "`dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future().then(lambda f: "
            "f.value()[0])`; or remove the hook."
        )
    elif unsynced_steps(v, steps):
        sites = sorted(v.meta(0).get("nosync_sites", []))  # rank 0 differs too; its strings always travel
        flag = bool(sites) and all(site.startswith("require_backward_grad_sync") for site in sites)
        labels = {"kind": "sync-off", "how": "require_backward_grad_sync" if flag else "no_sync"}
        fix = (
            "set model.require_backward_grad_sync = True on the last micro-step of each optimizer step, as nanoGPT "
            "does: model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)"
            if flag
            else "leave the last micro-batch of each optimizer step outside no_sync(): run its forward and backward "
            "without the context manager, so DDP reduces the accumulated gradients once before optimizer.step()"
        ) + (f" (at {sites[0].split(' at ', 1)[1]})." if sites and " at " in sites[0] else ".")
    return [
        Finding(
            code=Code.GRADS_NOT_SYNCED,
            severity="error",
            params=v.params(params),
            ranks=ranks,
            steps=steps,
            more_ranks=others.more,
            fix=fix,
            sites=lines_of(*sites),
            labels=labels,
        )
    ]


@detects(Code.IDENTICAL_INPUTS_ACROSS_RANKS, road="every")
def identical_inputs(a: Agreed) -> list[Finding]:
    """Ranks that fed the same inputs at every compared step, whatever the parallelism, unless the job has one
    data-parallel group beside tensor parallelism (every rank then rightly reads the same batches)."""
    if a.world < 2 or not a.inputs_compared or not a.inputs_identical or a.one_data_group:
        return []
    return [same_inputs(world=a.world, steps=a.inputs_compared)]


@detects(Code.TP_INPUTS_DIFFER, road="sharded")
def tp_inputs_sharded(run: ShardedRun) -> list[Finding]:
    """A tensor-parallel group beside the data-parallel mesh whose ranks fed different inputs."""
    if run.beside_apart is None:
        return []
    return [beside_inputs_apart(run.beside_apart, groups=run.beside_groups, compared=len(run.beside_compared))]


def same_inputs(*, world: int, steps: list[int]) -> Finding:
    """`identical-inputs-across-ranks`: at every one of `steps` (those whose inputs every rank saw) the inputs were
    the same on all `world` ranks."""
    return Finding(
        code=Code.IDENTICAL_INPUTS_ACROSS_RANKS,
        severity="warning",
        ranks=list(range(world)),
        steps=steps,
        measured=[Measure("steps_with_identical_inputs", len(steps), "count")],
        fix="shard the data: DataLoader(dataset, sampler=DistributedSampler(dataset)), and call "
        "sampler.set_epoch(epoch) every epoch.",
    )


def beside_inputs_apart(apart: dict[str, Any], *, groups: int, compared: int) -> Finding:
    """`tp-inputs-differ`: the ranks of some group beside the data-parallel mesh (a tensor-parallel group, which
    computes one forward together) fed different inputs at `apart["step"]` (`ShardedRun.beside_apart`); `groups` of
    them, compared at `compared` steps.

    Ground truth (tests/scripts/fsdp2_tp_sampler.py --sampler world, FSDP2 over a [2, 2] ("dp", "tp") mesh, plain
    torchrun): with the DistributedSampler built from the world (4 replicas) instead of the data-parallel mesh (2),
    ranks 0 and 1 start on different batches (first inputs 0.85 and -0.87), report different losses for what is one
    forward (1.445 and 1.319 at the first step), and each rank takes 8 steps per epoch instead of 16. Exit 0, no
    warning: the row-parallel layer sums partial products of different batches."""
    dims = "/".join(apart.get("dims") or ["tensor-parallel"])
    named = [g for g in apart["groups"] if g]
    first = named[0] if named else []
    exact = apart.get("exact", True)
    which = (
        f"{apart['count']} of the {groups} {dims} groups"
        if exact
        else f"some of the {groups} {dims} groups, those whose data-parallel index is "
        + " or ".join(str(s) for s in apart.get("slots", []))
        + " modulo 64 (the check tells 64 groups apart)"
    )
    site = apart.get("site")
    cause = (
        " The training loader's DistributedSampler holds the world's size, not the data-parallel degree: each rank "
        "reads its own share of the data, where the ranks of one group must read the same."
        if apart.get("sampler_world")
        else ""
    )
    return Finding(
        code=Code.TP_INPUTS_DIFFER,
        severity="error",
        title=f"{rank_list(first)} of one {dims} group fed different batches at step {apart['step']}"
        if first
        else f"the ranks of some {dims} groups fed different batches at step {apart['step']}",
        detail=f"FSDP2 shards this model over the data-parallel mesh; the ranks that differ only along {dims} compute "
        "each forward together (each holds a slice of the layers and their partial results are summed), so they "
        f"must feed it the same batch. At step {apart['step']}, in {which}, they did not (their inputs' "
        f"fingerprints differ; compared at {compared} step(s), differing at {len(apart['steps'])}): the layers "
        f"combine partial results of different batches, silently.{cause}",
        ranks=sorted({r for g in named for r in g}),
        steps=list(apart["steps"]),
        sites=lines_of(*([site] if site else [])),
        measured=[
            Measure("groups_with_different_inputs", apart["count"], "count"),
            Measure("steps_with_different_inputs", len(apart["steps"]), "count"),
        ],
        fix="give every rank of a group the same batches: build the DistributedSampler from the data-parallel mesh, "
        "DistributedSampler(dataset, num_replicas=mesh['dp'].size(), rank=mesh['dp'].get_local_rank()) "
        "(torchtitan's way), and seed any per-rank randomness of the data (augmentation, masking) by the "
        "data-parallel rank.",
    )
