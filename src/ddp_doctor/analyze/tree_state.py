"""What the module tree held at each step, beyond the lists DDP made when it was built: parameters created or
replaced after DDP was built (which DDP's reducer never syncs), and an optimizer that steps tensors the tree no longer
holds (the modules' train/eval modes apart are `replica_state.py`'s `replica-divergence`). The ranks' trees are compared by a digest per step (`StepCounters.state_digest`,
`observation.tree_scan`); rank 0 and the example ranks that differ from it say what they held then."""

from __future__ import annotations

from ddp_doctor.analyze.common import all_ranks, with_more
from ddp_doctor.analyze.parallelism import api_for, moved_words
from ddp_doctor.analyze.sharded_fixes import optimizer_fix
from ddp_doctor.analyze.tree_digest import differing, param_entry, parts_apart, step_apart
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of

__all__ = ["optimizer_params_replaced", "unregistered_parameters"]


@detects(Code.UNREGISTERED_PARAMETERS)
def unregistered_parameters(v: View) -> list[Finding]:
    """Trainable parameters in the module tree that DDP's reducer does not hold: created or replaced after DDP was
    built. Each rank trains them from its own gradient."""
    recast = _recast(v)
    counts = v.summary.unregistered
    first = next((s for s, n in enumerate(counts) if n), None)
    if first is None:
        return recast + _retied(v) + _outside(v)
    holders = v.ranks("unregistered")
    entries = next((v.meta(r).get("unregistered") for r in [0, *holders.ranks] if v.meta(r).get("unregistered")), [])
    params = [param_entry(e) for e in entries]
    names = ", ".join(p.name for p in params[:6]) + (f" (+{len(params) - 6} more)" if len(params) > 6 else "")
    sites = sorted({e["site"] for e in entries if e.get("site")})
    apart = "unregistered" in parts_apart(v)
    step, first_apart = step_apart(v, "unregistered")
    orphaned = v.orphaned.nonzero().flatten().tolist()
    left = v.params(orphaned)
    where = f", attached at {', '.join(sites[:3])} after DDP was built" if sites else ""
    stepped = [e.get("stepped") for e in entries]
    never_stepped = bool(stepped) and all(x is False for x in stepped)
    unused = all(e.get("used") is False for e in entries)  # (records without the key: assumed used)
    empty = (
        " (they hold no data yet: on the meta device, or a lazy module's before its first forward)"
        if all(e.get("data") is False for e in entries)
        else ""
    )
    detail = (
        f"DDP's reducer all-reduces the gradients of the parameters it registered when it was built"
        f"{f' ({v.info.ddp_site})' if v.info.ddp_site else ''}. {names} sit in the model's module tree from step "
        f"{first} on{where}"
        + (
            f", and no gradient reached them in the observed steps{empty}: "
            "the forward does not use them yet. If a later phase of the script uses them, no all-reduce will carry "
            "their gradients, and each rank will train them alone."
            if unused
            else ": the forward uses them, but no all-reduce carries their gradients"
            + (
                ", and the optimizer the check observed does not step them (optimizer-params-replaced): they do "
                "not train at all."
                if never_stepped
                else ", so each rank trains them alone."
            )
        )
    )
    if apart and first_apart:
        detail += f" They already differ across ranks at step {step}."
    elif apart:
        detail += (
            f" They differ across ranks at the last observed step ({step}); the ranks' trees differ in other state "
            "too, so the step at which these parted is not known."
        )
    elif not unused and any(e.get("readable", True) is False for e in entries):
        detail += " The check cannot read their values (a tensor subclass), so it did not compare them across ranks."
    elif never_stepped and not unused:
        detail += " They stayed equal on every rank in the observed steps, at their initial values."
    elif not unused:
        detail += (
            " They were equal on every rank in the observed steps (they did not change, or every rank computed the "
            "same gradients); they part as soon as the ranks' gradients differ."
        )
    if left:
        detail += (
            f" The module they replaced left {len(left)} parameter(s) in DDP's reducer "
            f"({', '.join(p.name for p in left[:4])}{', ...' if len(left) > 4 else ''}) that nothing uses any more: "
            "they get no gradient (with default flags DDP then fails with 'Expected to have finished reduction'), "
            "which is a consequence of the replacement, not a reason to freeze anything."
        )
    fix = (
        "build DDP after the model is complete: move the code that creates or replaces these parameters"
        + (f" ({sites[0]})" if sites else "")
        + " before `DistributedDataParallel(...)`; to change the model after wrapping, wrap the changed model in a "
        "new DistributedDataParallel and build the optimizer over its parameters."
    )
    ranks = holders.ranks if holders.count < v.world else all_ranks(v)
    return (
        recast
        + _outside(v)
        + [
            with_more(
                Finding(
                    code=Code.UNREGISTERED_PARAMETERS,
                    sites=lines_of(*sites),
                    severity="error" if apart else "warning",
                    title=f"{len(params)} trainable parameter(s) are not in DDP's reducer: created or replaced after "
                    + (
                        "DDP was built, unused so far"
                        if unused
                        else "DDP was built, and no optimizer steps them"
                        if never_stepped
                        else "DDP was built, each rank trains them alone"
                    ),
                    detail=detail,
                    params=params,
                    ranks=ranks,
                    steps=sorted({first, step}) if apart else [first],
                    # how many of the named a gradient reached, and how many hold values (a lazy or meta one: none)
                    measured=[
                        Measure("with_gradient", sum(1 for e in entries if e.get("used", True)), "count"),
                        Measure("holding_data", sum(1 for e in entries if e.get("data", True)), "count"),
                    ],
                    fix=fix,
                ),
                max(0, holders.count - len(ranks)),
            )
        ]
    )


def _outside(v: View) -> list[Finding]:
    """Trainable tensors the optimizer steps that the model never held (a learnable loss temperature kept beside the
    model: `SGD([*model.parameters(), temp])`), whose values or gradients differ across ranks: DDP syncs no gradient
    of theirs, so each rank trains them from its own. Tensors the script keeps equal itself (it all-reduces their
    gradients) are compared and not named.

    Ground truth (tests/sync/test_check_tree_state.py, plain torchrun, 2 ranks, 6 SGD steps): the temperature
    differs by 0.0099 across the ranks at the end, every model weight equal, exit 0. The check named it as a tensor
    of "a module replaced" that "no forward uses", with a fix about building the optimizer after the model."""
    mine = [e for e in v.meta(0).get("outside") or [] if e.get("grad")]
    odd, _ = differing(v)
    if not mine or not odd:
        return []
    theirs = [{e["name"]: e["fp"] for e in v.meta(r).get("outside") or []} for r in odd]
    apart = [e for e in mine if any(t.get(e["name"]) != e["fp"] for t in theirs)]
    if not apart:
        return []
    params = [param_entry(e) for e in apart]
    names = ", ".join(p.name for p in params[:4]) + (f" (+{len(params) - 4} more)" if len(params) > 4 else "")
    # Their gradients agree on every rank (the script averages them) while their values differ: they started apart.
    grads_apart = sum(any(t.get(e["name"], [])[2:] != e["fp"][2:] for t in theirs) for e in apart)
    held = f"no module DDP wraps{f' ({v.info.ddp_site})' if v.info.ddp_site else ''} holds them"
    step, first = step_apart(v, "outside")
    since = f"from step {step} on" if first else f"at the last observed step ({step})"
    attr = params[0].name.split(".")[-1]
    if grads_apart == 0:
        title = f"{len(params)} tensor(s) the optimizer trains outside the DDP model ({names}) differ across ranks, "
        title += "though their gradients agree"
        detail = (
            f"The optimizer steps {names} beside the model's parameters and the script averages their gradients, "
            f"but {held}, so nothing made their values equal: they differ across ranks {since} (created "
            "from each rank's own random state, or changed on some ranks), and equal updates keep them apart. DDP "
            "broadcasts rank 0's weights of the model it wraps only."
        )
        fix = (
            "create them alike on every rank (one seed for all ranks), or broadcast rank 0's once before training "
            "(`dist.broadcast(t.data, src=0)`); or register them on the model before DDP is built, which broadcasts "
            "them with the rest."
        )
    else:
        title = f"the optimizer trains {len(params)} tensor(s) held outside the DDP model ({names}): each rank "
        title += "trains them alone"
        detail = (
            f"The optimizer steps {names} beside the model's parameters, and the loss gives them a gradient, but "
            f"{held}, so DDP all-reduces no gradient of theirs: each rank steps them from its own batch's gradient. "
            f"They differ across ranks {since} (values or gradients at the optimizer step), while DDP "
            "keeps the model's own weights equal."
        )
        fix = (
            f"register them on the model before DDP is built (`model.{attr if attr.isidentifier() else 'scale'} = "
            "nn.Parameter(...)`, used through `ddp_model.module`, or better inside the model's forward), so DDP "
            "averages their gradients with the others'; or all-reduce their gradients before optimizer.step(): "
            "`dist.all_reduce(t.grad); t.grad /= dist.get_world_size()`."
        )
    return [
        Finding(
            code=Code.UNREGISTERED_PARAMETERS,
            severity="error",
            title=title,
            detail=detail,
            params=params,
            ranks=all_ranks(v),
            steps=[step],
            measured=[Measure("gradients_apart", grads_apart, "count")],
            fix=fix,
        )
    ]


def _recast(v: View) -> list[Finding]:
    """Parameters DDP registered whose dtype or device changed after it was built (`model.to(torch.bfloat16)`
    after the wrap). The tensor keeps its identity, but a parameter whose dtype or device changes gets a new gradient
    accumulator, and DDP's reducer hooked the old one: no gradient of theirs is all-reduced, and DDP raises nothing.

    Ground truth (tests/sync/test_check_tree_state.py, plain torchrun, 2 ranks, 8 SGD steps): after
    `model = model.to(torch.bfloat16)` following the wrap, the ranks' weights differ by 0.034, exit 0, with
    find_unused_parameters False or True; the same cast before the wrap keeps them equal."""
    meta = v.meta(0)
    entries, count = meta.get("recast") or [], int(meta.get("recast_count") or 0)
    if not entries:
        return []
    index = {n: i for i, n in enumerate(v.info.param_names)}
    params = v.params([index[e["name"]] for e in entries if e.get("name") in index])
    site = next((e["site"] for e in entries if e.get("site")), None)
    was, now = entries[0]["was"], entries[0]["now"]
    where = f" at {site}" if site else ""
    return [
        Finding(
            code=Code.UNREGISTERED_PARAMETERS,
            sites=lines_of(*([site] if site else [])),
            severity="error",
            title=f"{count} parameter(s) were converted from {was} to {now} after DDP was built: DDP no longer "
            "syncs their gradients",
            detail=f"DDP registered the model's parameters when it was built"
            f"{f' ({v.info.ddp_site})' if v.info.ddp_site else ''} and hooked each one's gradient accumulator. The "
            f"script then converted {count} of them{where} ({was} to {now}): a parameter whose dtype or device "
            "changes gets a new gradient accumulator, so DDP's hooks never fire, no gradient of theirs is "
            "all-reduced, and each rank trains them alone. DDP raises no error.",
            params=params,
            ranks=all_ranks(v),
            steps=[0],
            measured=[Measure("parameters_converted_after_wrap", count, "count")],
            fix="convert the model before wrapping it: model.to(dtype or device), then DistributedDataParallel(model)"
            " and the optimizer; to compute in bfloat16 with float32 weights, keep the model as it is and run the "
            "forward under torch.autocast(device_type, dtype=torch.bfloat16).",
        )
    ]


def _retied(v: View) -> list[Finding]:
    """Names that held a parameter DDP registered and now hold another one it registered: a weight tied after DDP
    was built (`model.module.head.weight = model.module.embed.weight`). DDP syncs the shared parameter under its own
    name, while its reducer still waits for the tensor the re-tied name held, which nothing uses any more.

    Ground truth (tests/sync/test_check_tree_state.py): under plain torchrun such a job fails at its second step
    with 'Expected to have finished reduction in the prior iteration' (default flags); its first step's gradients
    were not all-reduced. With find_unused_parameters=True it trains, the shared weight in sync."""
    entries = v.meta(0).get("retied") or []
    if not entries or not v.orphaned.any():
        return []
    index = {n: i for i, n in enumerate(v.info.param_names)}
    left = [index[e["name"]] for e in entries if e["name"] in index]
    sites = sorted({e["site"] for e in entries if e.get("site")})
    pairs = ", ".join(f"{e['name']} = {e['now']}" for e in entries[:4])
    where = f" at {', '.join(sites[:3])}" if sites else ""
    effect = (
        ": it never gets a gradient, so with find_unused_parameters=False DDP's reduction never finishes (the "
        "step's gradients in its bucket are not all-reduced), and the next step fails with 'Expected to have "
        "finished reduction'."
        if not v.find_unused
        else ": it never gets a gradient, which find_unused_parameters=True tolerates (the shared weight trains "
        "in sync, at the cost of DDP's search of the graph every step)."
    )
    return [
        Finding(
            code=Code.UNREGISTERED_PARAMETERS,
            sites=lines_of(*sites),
            severity="error" if not v.find_unused else "info",
            title=f"a weight was tied after DDP was built ({pairs}): DDP's reducer still holds the old tensor",
            detail=f"DDP registered the model's parameters when it was built"
            f"{f' ({v.info.ddp_site})' if v.info.ddp_site else ''}. After that, {pairs}{where}: the forward uses "
            "the shared parameter through both names, and DDP syncs it under the name it registered, but its "
            f"reducer still holds the tensor {entries[0]['name']} held before, which nothing uses any more" + effect,
            params=v.params(left),
            ranks=all_ranks(v),
            steps=[0],
            fix="tie the weights before wrapping (model.head.weight = model.embed.weight, then "
            "DistributedDataParallel(model)): DDP registers the shared tensor once; build the optimizer after.",
        )
    ]


@detects(Code.OPTIMIZER_PARAMS_REPLACED, road="every")
def optimizer_params_replaced(a: Agreed) -> list[Finding]:
    """The optimizer steps tensors the model no longer holds: a module replaced after the optimizer was built (its
    replacement's parameters get gradients that no optimizer applies), or, for a sharded model, the optimizer built
    before `fully_shard` (or `replicate`) replaced every parameter, so that it steps none of the model's and only
    tensors no observed step gave a gradient.

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 AdamW steps (`tests/scripts/fsdp2_train.py`):
    the optimizer built before `fully_shard` (`--mistake optimizer-before`) changes no weight, exit 0. Its neighbour,
    every parameter of the model frozen and a temperature beside it the only tensor the optimizer steps
    (`--mistake frozen-model,temperature-synced`, a prompt tuned on a frozen model), trains the temperature
    (0.015132 on both ranks) and leaves the model as it was, as meant: no stale optimizer (the check called it one,
    at error)."""
    if (s := a.stale_optimizer) is None:
        return []
    ranks, steps = list(range(a.world)), list(range(s.steps))
    if not s.wholesale:
        old = f" ({', '.join(p.name for p in s.params[:4])}{', ...' if len(s.params) > 4 else ''} of a module replaced after it was built)"
        new = (
            f" The parameters that replaced them ({', '.join(s.replacements[:4])}) get gradients no optimizer applies."
        )
        return [
            Finding(
                code=Code.OPTIMIZER_PARAMS_REPLACED,
                severity="error",
                title=f"the optimizer steps {s.stale} tensor(s) that are no longer the model's",
                detail=f"The optimizer holds {s.stale} tensor(s) that the model's module tree no longer holds"
                + (old if s.params else "")
                + ": it updates them, and no forward uses them."
                + (new if s.replacements else ""),
                params=s.params,
                ranks=ranks,
                steps=steps,
                labels={"kind": "module-replaced"},
                measured=[Measure("stale_tensors", s.stale, "count")],
                fix="build the optimizer after the model is final (after every module replacement), over "
                "`model.parameters()`; after replacing a module mid-training, build a new optimizer (and DDP) over "
                "the new parameters.",
            )
        ]
    api = api_for(a.parallelism)
    measured = moved_words(steps=s.steps, moved=s.moved, model_params=s.model_params)
    return [
        Finding(
            code=Code.OPTIMIZER_PARAMS_REPLACED,
            severity="error",
            title=f"the optimizer steps {s.stale} parameters that are no longer the model's",
            detail=f"The optimizer ({s.optimizer}) was built before {api.call}. {api.call} replaces every parameter "
            f"of the modules it takes with a new DTensor parameter {api.holds}, so the "
            "optimizer holds the old tensors, which no forward uses and no gradient reaches, and none of the "
            f"model's {s.model_params} parameters. Training runs, the loss is computed, and nothing learns. "
            + measured,
            ranks=ranks,
            steps=steps,
            fix=optimizer_fix(a.framework, api.call, api.done),
            sites=lines_of(s.optimizer),
            labels={
                "kind": "built-before-wrap",
                "optimizer": s.optimizer.split(" ", 1)[0],
                "weights_moved": "not-measured" if s.steps < 2 else "yes" if s.moved else "no",
            },
            measured=[
                Measure("stale_tensors", s.stale, "count"),
                Measure("model_params", s.model_params, "count"),
                Measure("steps_observed", s.steps, "count"),
            ],
        )
    ]
