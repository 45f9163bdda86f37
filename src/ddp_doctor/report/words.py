"""The sentences of the findings whose detectors leave them to the report: each code's title and detail, written
from the finding's typed evidence alone (its parameters, ranks, steps, `labels`, `measured`, `sites`), the way
rich's `Table.add_row` takes the data and `__rich_console__` writes it out. `ReportData.build` words every finding
it is given; a finding that already carries its text (a code not moved here yet) is left as it is.

A code is moved here by giving it a function below and removing `title=` and `detail=` from its builders, which
then put whatever the words need into the evidence (`tests/design/test_one_road.py` holds every builder of a code
registered here to that). The labels each code's words read are in docs/json-schema.md's table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ddp_doctor.core.codes import PARALLELISMS, Code
from ddp_doctor.core.findings import Finding, count
from ddp_doctor.core.ranks import listed, rank_list

__all__ = ["WORDS", "worded"]

Words = Callable[[Finding], tuple[str, str]]
WORDS: dict[str, Words] = {}
"""The title and detail of each code moved here, from its finding's evidence."""

_CALL = {"fsdp2": "fully_shard", "replicate": "replicate"}
"""The call that builds a sharded model of each parallelism."""


def worded(f: Finding) -> Finding:
    """`f` with its title and detail written from its evidence where its code's words are here and it has none."""
    words = WORDS.get(f.code)
    if words is None or f.title:
        return f
    title, detail = words(f)
    return dataclasses.replace(f, title=title, detail=detail)


def _words(code: Code) -> Callable[[Words], Words]:
    def register(fn: Words) -> Words:
        WORDS[str(code)] = fn
        return fn

    return register


def _flag(f: Finding, name: str) -> bool:
    """A DDP flag the finding recorded (`labels`, ``"True"``/``"False"``)."""
    return f.labels.get(name) == "True"


def _default_flags(f: Finding) -> bool:
    return not _flag(f, "find_unused_parameters") and not _flag(f, "static_graph")


@_words(Code.UNUSED_PARAMETERS)
def _unused_parameters(f: Finding) -> tuple[str, str]:
    """Labels: `parallelism`, `modules_ran` (``"False"`` where their modules were seen never to run), and DDP's
    `find_unused_parameters` and `static_graph`. The steps are every observed one."""
    n, parallelism = len(f.steps), f.labels.get("parallelism", "ddp")
    seen = (
        " and their modules never ran in a training forward"
        if f.labels.get("modules_ran") == "False"
        else ": nothing in the loss reaches them"
    )
    if parallelism == "ddp":
        steps = f"every one of the {n} observed steps"
        if _default_flags(f):
            effect = (
                "With find_unused_parameters=False and static_graph=False DDP waits for their gradients: the step's "
                "gradients are never all-reduced, then the next step fails with 'Expected to have finished reduction'."
            )
        else:
            walks = " and walks the autograd graph to find them." if _flag(f, "find_unused_parameters") else "."
            effect = f"The current flags cope, but DDP still all-reduces zeros for them every step{walks}"
    else:
        steps = f"every one of the {n} observed optimizer steps with gradient sync on"
        name = PARALLELISMS[parallelism]
        carried = (
            "the all-gathers of their fully_shard group still carry them in every forward"
            if _CALL[parallelism] == "fully_shard"
            else "every rank still holds a whole copy of them"
        )
        effect = (
            f"{name} raises no error for them, unlike DDP with default flags; they do not train, and {carried}. If "
            "a later phase of the script uses them (a curriculum, an auxiliary loss switched on later), nothing is "
            "wrong."
        )
    return (
        f"{count(len(f.params), 'trainable parameter')} never reached the loss",
        f"On every rank and {steps}, these parameters got no gradient{seen}. {effect}",
    )


@_words(Code.GRAD_BLOCKED)
def _grad_blocked(f: Finding) -> tuple[str, str]:
    """Labels: `kind` (``checkpoint``: a reentrant one, whose lines are the `sites`, or ``cut``), DDP's flags."""
    if f.labels.get("kind") == "checkpoint":
        cause = (
            f"a reentrant checkpoint none of whose inputs requires grad ({', '.join(f.sites)}): the checkpointed "
            "block runs without building a graph, so no gradient ever reaches it"
        )
    else:
        cause = (
            "their modules ran, but the output was cut from the graph: torch.no_grad(), .detach(), or a reentrant "
            "checkpoint whose inputs do not require grad"
        )
    waits = " while DDP waits for their gradients" if _default_flags(f) else ""
    return (
        f"{count(len(f.params), 'parameter')} ran in forward but never got a gradient",
        f"On every rank and every one of the {len(f.steps)} observed steps these parameters' modules ran, yet no "
        f"gradient reached them: {cause}. The script evidently means to train them, so they silently stay at their "
        f"initial values{waits}.",
    )


@_words(Code.DYNAMIC_GRAPH)
def _dynamic_graph(f: Finding) -> tuple[str, str]:
    """Labels: DDP's flags. The steps are those on which some of the parameters got no gradient."""
    uses = _flag(f, "find_unused_parameters") and not _flag(f, "static_graph")
    return (
        f"{count(len(f.params), 'parameter')} reach the loss on some steps but not others",
        "The set of parameters that get a gradient changes from step to step (for example a branch taken on some "
        "steps). Only find_unused_parameters=True handles a used-set that changes"
        + (", which is what this run uses." if uses else "."),
    )


@_words(Code.RANK_DEPENDENT_GRAPH)
def _rank_dependent_graph(f: Finding) -> tuple[str, str]:
    """From the exchange: the ranks are those that left the parameters without a gradient. From DDP's reduction
    error (label `kind` ``crash``): `failed_rank` raised it at the step after `steps`' one, the other
    ranks closed that step with a gradient for every parameter."""
    if f.labels.get("kind") == "crash":
        failed, [step] = int(f.labels["failed_rank"]), f.steps
        trained = rank_list(r for r in f.ranks if r != failed)
        return (
            f"{len(f.params)} parameter(s) got a gradient on {trained} but not on rank {failed} in step {step}",
            f"Rank {failed} failed at the start of step {step + 1} because these parameters got no gradient in "
            f"step {step}; {trained} closed that step with a gradient for every one of them (then waited for rank "
            f"{failed} in a collective). The set of parameters that reach the loss depends on the rank: a branch on "
            "the rank, or a task only some ranks have data for. With default flags DDP cannot reduce such a set.",
        )
    return (
        f"{count(len(f.params), 'parameter')} reach the loss on some ranks but not others",
        f"Ranks {listed(f.ranks, f.more_ranks)} left these parameters without a gradient while other ranks used them. "
        "With default flags the ranks disagree on which buckets are ready, which hangs or crashes. static_graph=True "
        "handles it when each rank's set is the same every step; find_unused_parameters=True handles it always.",
    )


@_words(Code.STATIC_GRAPH_UNSAFE)
def _static_graph_unsafe(f: Finding) -> tuple[str, str]:
    """Label `kind`: ``crashed`` (DDP failed on the ranks with 'Your training graph has changed') or ``changed``
    (the used set changed between the observed steps)."""
    then = (
        f"DDP failed on rank(s) {listed(f.ranks, f.more_ranks)} with 'Your training graph has changed'."
        if f.labels.get("kind") == "crashed"
        else "Here they changed, so gradients would be reduced wrongly."
    )
    return (
        "static_graph=True, but the graph changes between steps",
        "static_graph=True records the used parameters on the first steps and assumes they never change. " + then,
    )


@_words(Code.FIND_UNUSED_UNNEEDED)
def _find_unused_unneeded(f: Finding) -> tuple[str, str]:
    """Measured: `parameters_used`; the ranks and steps are every one."""
    used = next(int(m.value) for m in f.measured if m.name == "parameters_used")
    return (
        "find_unused_parameters=True, but every parameter is used",
        f"All {used} trainable parameters got a gradient on every one of the {len(f.ranks)} ranks in all "
        f"{len(f.steps)} observed steps. find_unused_parameters=True makes DDP walk the whole autograd graph after "
        "every forward and delays communication, for nothing.",
    )


@_words(Code.GRADS_NOT_SYNCED)
def _grads_not_synced(f: Finding) -> tuple[str, str]:
    """Label `kind`: the mechanism where one was seen (``sync-off``, `how` it was off, its lines the `sites`;
    ``comm-hook``, the `hook`, its line the site; ``local-sgd``, post-local SGD by design, with the `subgroup_size`
    and the measured `first_local_step` and `start_localSGD_iter`); none where the gradients differ for a cause
    the other findings name or none seen."""
    kind, n = f.labels.get("kind"), len(f.params)
    if kind == "local-sgd":
        return _local_sgd(f)
    off, why = "", ""
    if kind == "comm-hook":
        hook, where = f.labels["hook"], f" (defined at {f.sites[0]})" if f.sites else ""
        why = (
            f" DDP hands each gradient bucket to the comm hook {hook}{where}, registered with register_comm_hook, "
            "instead of all-reducing it itself; the gradients the hook handed back differ across ranks, so it does "
            "not all-reduce (and average) every bucket alike on every rank."
        )
    elif kind == "sync-off":
        flag = f.labels.get("how") == "require_backward_grad_sync"
        call, verb = ("require_backward_grad_sync=False", "set") if flag else ("no_sync()", "entered")
        where = f" ({verb} at {'; '.join(f.sites)})" if f.sites else ""
        off = f" (DDP's sync was off for every backward: {call})" if f.sites else ""
        how = "with require_backward_grad_sync=False" if flag else "under no_sync()"
        why = (
            f" Every backward pass of these optimizer steps ran {how}{where}, the last micro-batch included, so DDP "
            "never reduced the gradients: each rank stepped on its own."
        )
    return (
        f"gradients of {count(n, 'parameter')} differ across ranks at the optimizer step{off}",
        "When the optimizer stepped, these gradients were not the same on every rank, so the replicas take "
        f"different updates. Ranks {listed(f.ranks, f.more_ranks)} disagree in steps {f.steps}.{why}",
    )


def _local_sgd(f: Finding) -> tuple[str, str]:
    measured = {m.name: int(m.value) for m in f.measured}
    first, began, subgroup = (
        measured["first_local_step"],
        measured["start_localSGD_iter"],
        f.labels.get("subgroup_size"),
    )
    alone = subgroup == "1"
    over = "one rank" if alone else f"subgroups of {subgroup} ranks" if subgroup else "subgroups"
    before = (
        f" The gradients agreed across the ranks at step{'s 0-' if first > 1 else ' '}{first - 1}." if first else ""
    )
    return (
        f"post-local SGD: from step {first} the gradients are averaged over {over}, not all ranks",
        "DDP hands each gradient bucket to torch's post_localSGD_hook, which all-reduces it over every rank for "
        f"the first {began} iterations (start_localSGD_iter={began}) and over {over} after: each "
        f"{'rank' if alone else 'subgroup'} steps on its own gradients and the replicas part until a model averager "
        f"averages the parameters. That is the algorithm, not a fault.{before}",
    )


@_words(Code.REDUCTION_ERROR)
def _reduction_error(f: Finding) -> tuple[str, str]:
    """DDP's 'Expected to have finished reduction' at the step of `steps`. Label `kind`: ``second-pass`` (at the
    second backward pass through one forward, the passes' lines the `sites`), ``replaced`` (the parameters are a
    replaced module's, left in DDP's reducer); none for trainable parameters that got no gradient."""
    [step] = f.steps[:1] or [0]
    kind = f.labels.get("kind")
    if kind == "second-pass":
        where = f" ({', '.join(f.sites)})" if f.sites else ""
        return (
            "DDP failed: 'Expected to have finished reduction', at a second backward pass through one forward",
            f"Two backward passes through one forward{where}: DDP failed at the second one in step {step}. The "
            "framework prepares DDP's reduction at each backward pass (Lightning's manual_backward), and the first "
            "pass gave no gradient to these parameters, so its reduction never finished. They get their gradient in "
            "the later pass: they are trained, not unused.",
        )
    why = (
        "these parameters, which DDP registered when it was built, are no longer in the model (a module replaced "
        "after wrapping left them in DDP's reducer), so they never get a gradient"
        if kind == "replaced"
        else "because these trainable parameters got no gradient"
    )
    return (
        "DDP failed: 'Expected to have finished reduction in the prior iteration'",
        f"At the start of step {step}, DDP found that the previous step's gradient reduction never finished"
        f"{': ' if kind == 'replaced' else ', '}{why}. Until it failed, the previous step's gradients were silently "
        "not all-reduced.",
    )


@_words(Code.NO_TRAINABLE_PARAMETERS)
def _no_trainable(f: Finding) -> tuple[str, str]:
    return (
        "no parameter requires a gradient",
        "At some observed step every parameter had requires_grad=False, so the step trains nothing.",
    )
