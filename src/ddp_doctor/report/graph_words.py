"""The words of the used set's findings and of DDP's own errors about it (the parameters that reach the loss,
DDP's flags, a reduction that never finished, parameters used where DDP's forward does not see them), from their
evidence (`ddp_doctor.report.words`)."""

from __future__ import annotations

from ddp_doctor.core.codes import PARALLELISMS, Code
from ddp_doctor.core.findings import Finding, count
from ddp_doctor.core.ranks import listed, rank_list
from ddp_doctor.report.wording import default_flags, finds_unused, flag, value_of, words

__all__: list[str] = []


@words(Code.UNUSED_PARAMETERS)
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
        if default_flags(f):
            effect = (
                "With find_unused_parameters=False and static_graph=False DDP waits for their gradients: the step's "
                "gradients are never all-reduced, then the next step fails with 'Expected to have finished reduction'."
            )
        else:
            walks = " and walks the autograd graph to find them." if flag(f, "find_unused_parameters") else "."
            effect = f"The current flags cope, but DDP still all-reduces zeros for them every step{walks}"
    else:
        steps = f"every one of the {n} observed optimizer steps with gradient sync on"
        name = PARALLELISMS[parallelism]
        carried = (
            "the all-gathers of their fully_shard group still carry them in every forward"
            if parallelism == "fsdp2"
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


@words(Code.GRAD_BLOCKED)
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
    waits = " while DDP waits for their gradients" if default_flags(f) else ""
    return (
        f"{count(len(f.params), 'parameter')} ran in forward but never got a gradient",
        f"On every rank and every one of the {len(f.steps)} observed steps these parameters' modules ran, yet no "
        f"gradient reached them: {cause}. The script evidently means to train them, so they silently stay at their "
        f"initial values{waits}.",
    )


@words(Code.DYNAMIC_GRAPH)
def _dynamic_graph(f: Finding) -> tuple[str, str]:
    """Labels: DDP's flags. The steps are those on which some of the parameters got no gradient."""
    return (
        f"{count(len(f.params), 'parameter')} reach the loss on some steps but not others",
        "The set of parameters that get a gradient changes from step to step (for example a branch taken on some "
        "steps). Only find_unused_parameters=True handles a used-set that changes"
        + (", which is what this run uses." if finds_unused(f) else "."),
    )


@words(Code.RANK_DEPENDENT_GRAPH)
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


@words(Code.STATIC_GRAPH_UNSAFE)
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


@words(Code.FIND_UNUSED_UNNEEDED)
def _find_unused_unneeded(f: Finding) -> tuple[str, str]:
    """Measured: `parameters_used`; the ranks and steps are every one."""
    used = int(value_of(f, "parameters_used"))
    return (
        "find_unused_parameters=True, but every parameter is used",
        f"All {used} trainable parameters got a gradient on every one of the {len(f.ranks)} ranks in all "
        f"{len(f.steps)} observed steps. find_unused_parameters=True makes DDP walk the whole autograd graph after "
        "every forward and delays communication, for nothing.",
    )


@words(Code.REDUCTION_ERROR)
def _reduction_error(f: Finding) -> tuple[str, str]:
    """DDP's 'Expected to have finished reduction' at the step of `steps`. Label `kind`: ``second-pass`` (at the
    second backward pass through one forward, the passes' lines the `sites`), ``replaced`` (the parameters are a
    replaced module's, left in DDP's reducer); none for trainable parameters that got no gradient."""
    step = f.steps[0] if f.steps else 0
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


@words(Code.NO_TRAINABLE_PARAMETERS)
def _no_trainable(f: Finding) -> tuple[str, str]:
    return (
        "no parameter requires a gradient",
        "At some observed step every parameter had requires_grad=False, so the step trains nothing.",
    )


_MARKED_TWICE = "'Expected to mark a variable ready only once'"
"""DDP's error for a gradient that arrives after its parameter was marked unused."""


@words(Code.USED_OUTSIDE_FORWARD)
def _used_outside_forward(f: Finding) -> tuple[str, str]:
    """Labels: DDP's flags (find_unused_parameters=True without static_graph breaks on it)."""
    effect = (
        f"With find_unused_parameters=True DDP marks them unused after forward and then their gradient arrives "
        f"anyway: {_MARKED_TWICE}."
        if finds_unused(f)
        else f"The current flags cope, but find_unused_parameters=True would crash with {_MARKED_TWICE}."
    )
    return (
        f"{count(len(f.params), 'parameter')} used outside DDP's forward",
        "These parameters got a gradient, but they are not part of the autograd graph of DDP's forward outputs: "
        f"the loss uses them after forward (for example ddp.module.head(features)). {effect}",
    )


@words(Code.REENTRANT_CHECKPOINT)
def _reentrant_checkpoint(f: Finding) -> tuple[str, str]:
    """Label `kind` ``no-grad-inputs``: a reentrant checkpoint none of whose inputs requires grad, at the `sites`;
    otherwise reentrant checkpointing seen, with DDP's flags as labels."""
    if f.labels.get("kind") == "no-grad-inputs":
        return (
            f"reentrant checkpoint without grad-requiring inputs at {', '.join(f.sites)}",
            "torch.utils.checkpoint with use_reentrant=True gives the checkpointed block no gradient at all when "
            "none of the call's tensor inputs requires grad (PyTorch only warns). Its parameters look unused, but "
            "freezing them would be the wrong fix: the script means to train them.",
        )
    if finds_unused(f):
        effect = (
            "With find_unused_parameters=True DDP marks them unused after forward, then the nested backward "
            f"produces their gradient: {_MARKED_TWICE}."
        )
    elif flag(f, "static_graph"):
        effect = "static_graph=True handles it."
    else:
        effect = (
            "Default flags happened to reduce correctly here, but correctness then depends on the order gradients "
            "become ready; static_graph=True does not."
        )
    return (
        "reentrant activation checkpointing inside DDP",
        "torch.utils.checkpoint with use_reentrant=True runs a nested backward for the checkpointed segment, so its "
        f"parameters are invisible in the graph of DDP's forward outputs. {effect}",
    )
