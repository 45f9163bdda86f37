"""Several backward passes through one DDP forward (a GAN whose discriminator and generator losses come from one
forward of one module): `backward-passes-differ`, and what the flags can do about it.

DDP prepares one gradient reduction per forward and reduces each parameter once, in the pass where its bucket
completes. Measured with plain torchrun (torch 2.13, gloo, 2 ranks) on a GAN whose two losses come from one forward:
- a plain loop (`d_loss.backward(retain_graph=True)`, then `g_loss.backward()`): with the default flags a parameter
  reached by both passes crashes DDP ('Expected to mark a variable ready only once'); a second pass after the first
  completed every bucket is never reduced (silent drift); find_unused_parameters=True and static_graph=True fail as
  well. Only when every parameter gets its gradient in exactly one pass are the default flags right.
- Lightning's manual optimization (`manual_backward` twice in `training_step`): Lightning prepares the reduction at
  each `manual_backward`, from that pass's loss. The default flags fail with 'Expected to have finished reduction'
  at the second pass, static_graph=True with 'Your training graph has changed'; find_unused_parameters=True works.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddp_doctor.analyze.common import all_ranks, with_flags
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, ParamRef, lines_of

__all__ = ["Passes", "backward_passes_differ", "passes_of"]


@dataclass
class Passes:
    """What the ranks saw of several backward passes through one forward."""

    steps: list[int] = field(default_factory=list)
    """Common steps in which some rank's passes through one forward reached different parameters."""
    inner: bool = False
    """The passes ran inside DDP's forward (Lightning's manual optimization), which prepares the reduction per pass."""
    crashed: bool = False
    """A rank's DDP failed with 'Expected to have finished reduction' in a backward pass after an earlier one through
    the same forward: the framework prepares DDP per pass (Lightning), and the first left the reduction unfinished."""
    crashed_twice: bool = False
    """A rank's DDP failed with 'mark a variable ready only once' in a backward pass after an earlier one through the
    same forward: a parameter reached by both passes of a plain loop."""
    sites: list[str] = field(default_factory=list)
    """`file:line` of each backward pass (group rank 0's first such step)."""
    params: list[ParamRef] = field(default_factory=list)
    """Parameters that some of those passes did not reach."""

    @property
    def seen(self) -> bool:
        return bool(self.steps) or self.crashed or self.crashed_twice

    @property
    def flag_fixes(self) -> bool:
        """find_unused_parameters=True makes each pass reduce its own set (Lightning prepares DDP per pass)."""
        return self.inner or self.crashed

    def where(self) -> str:
        """' (file:line, file:line)' or ''."""
        return f" ({', '.join(self.sites)})" if self.sites else ""


def passes_of(v: View) -> Passes:
    steps = [i for i, x in enumerate(v.summary.split_passes[: v.steps]) if x]
    after_pass = bool(v.ranks("crash-after-pass").count)
    crashed = after_pass and bool(v.crashed(Code.REDUCTION_ERROR).count)
    crashed_twice = after_pass and bool(v.crashed("mark-ready-twice").count)
    inner = any(v.summary.inner_passes[: v.steps])
    meta = v.summary.metas.get(0) or next(iter(v.summary.metas.values()), {})
    sites = [s.split(": ", 1)[1] if s.startswith("step ") else s for s in meta.get("pass_sites", [])]
    return Passes(
        steps=steps,
        inner=inner,
        crashed=crashed,
        crashed_twice=crashed_twice,
        sites=sites,
        params=v.params(list(meta.get("split_params", []))),
    )


@detects(Code.BACKWARD_PASSES_DIFFER)
def backward_passes_differ(v: View) -> list[Finding]:
    p = passes_of(v)
    if not p.steps and not p.crashed_twice:
        return []  # a crash before the second pass is explained by reduction-error, which names the passes
    title = f"backward passes through one DDP forward reach different parameters{p.where()}"
    if p.inner and p.steps:
        handled = v.find_unused and not v.static_graph
        detail = (
            "Two or more backward passes ran inside one forward through DDP (manual_backward in training_step) and "
            "gave gradients to different parameters. Lightning prepares DDP's reduction at each manual_backward, "
            "from that pass's loss: "
            + (
                "with find_unused_parameters=True, which this run uses, DDP finds each pass's own set."
                if handled
                else "only find_unused_parameters=True lets DDP find each pass's own set. With the default flags DDP "
                "fails at the second pass ('Expected to have finished reduction'), with static_graph=True at the "
                "next step ('Your training graph has changed')."
            )
        )
        return [
            Finding(
                code=Code.BACKWARD_PASSES_DIFFER,
                severity="info" if handled else "error",
                title=title,
                detail=detail,
                params=p.params,
                ranks=all_ranks(v),
                steps=p.steps,
                sites=lines_of(*p.sites),
                labels={"kind": "manual-backward", "outcome": "handled" if handled else "needs-find-unused"},
                fix="" if handled else with_flags(v, find_unused_parameters=True, static_graph=False) + ".",
            )
        ]
    broken = any(v.ranks(f).count for f in ("grad-differs", "weight-differs", "crashed"))
    steps = p.steps or v.crash_steps("mark-ready-twice")
    detail = (
        "Two or more backward passes ran through one forward of the DDP model (each loss's backward after the "
        "same forward) and gave gradients to different parameters. DDP prepares one gradient reduction per "
        "forward and all-reduces each parameter once, in the pass where its bucket completes: a gradient that "
        "arrives in a later pass is left unreduced on each rank, and a parameter reached by two passes before "
        "the reduction completes crashes DDP ('Expected to mark a variable ready only once'). No DDP flag "
        "changes that: find_unused_parameters=True and static_graph=True fail on this pattern too."
        + (
            " Here DDP failed in the second pass ('Expected to mark a variable ready only once'): the parameters "
            "it names got a gradient in both passes; they are used inside forward, not outside it."
            if p.crashed_twice
            else ""
        )
    )
    if not broken:
        detail += (
            " Here every parameter got its gradient in exactly one pass, so the reduction was right; a change to "
            "either loss that reaches a parameter of the other pass breaks it."
        )
    return [
        Finding(
            code=Code.BACKWARD_PASSES_DIFFER,
            severity="error" if broken else "warning",
            title=title,
            detail=detail,
            params=p.params,
            ranks=all_ranks(v),
            steps=steps,
            sites=lines_of(*p.sites),
            labels={
                "kind": "one-forward",
                "outcome": "crashed" if p.crashed_twice else "broken" if broken else "each-parameter-once",
            },
            fix="give each backward pass its own forward through the DDP model (with find_unused_parameters=True, "
            "since their parameter sets differ), or wrap the generator and the discriminator in DDP models of their "
            "own, so that each loss's backward follows its own forward.",
        )
    ]
