"""Parameters whose gradients DDP's forward did not see coming: used in the loss outside DDP's forward
(`used-outside-forward`), or inside reentrant activation checkpointing (`reentrant-checkpoint`): each got a
gradient, but is not in the autograd graph of the forward's outputs that DDP prepares its reduction from. Each reads
the `View` and returns findings; the rest of the used set is `used_set.py`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddp_doctor.analyze.common import all_ranks, flag_labels, has_flags, steps_of, with_flags
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, lines_of

__all__ = ["Hidden", "hidden_params", "reentrant_checkpoint", "used_outside_forward"]


@dataclass
class Hidden:
    """Parameters that got a gradient but are not in the graph of DDP's forward outputs."""

    params: set[int] = field(default_factory=set)
    ranks: list[int] = field(default_factory=list)
    more_ranks: int = 0
    steps: set[int] = field(default_factory=set)
    crashed: int = 0
    """Ranks where DDP failed with 'mark a variable ready only once' because of them."""

    def seen(self, v: View) -> dict[str, Any]:
        """A finding's evidence of them: the parameters, the ranks (and how many more) and the steps."""
        return {
            "params": v.params(sorted(self.params)),
            "ranks": self.ranks,
            "more_ranks": self.more_ranks,
            "steps": sorted(self.steps),
        }


def hidden_params(v: View) -> tuple[Hidden, Hidden]:
    """(used outside forward, used under reentrant checkpoints), from every step including a crashed one."""
    out = []
    for k, predicate in enumerate(("hidden-outside", "hidden-reentrant")):
        ex = v.ranks(predicate)
        out.append(
            Hidden(
                params=set(steps_of(v.summary.hidden[k])),
                ranks=ex.ranks,
                more_ranks=ex.more,
                steps=set(steps_of(v.summary.hidden_steps[k])),
                crashed=v.summary.hidden_crashed[k],
            )
        )
    return out[0], out[1]


@detects(Code.USED_OUTSIDE_FORWARD)
def used_outside_forward(v: View) -> list[Finding]:
    outside, _ = hidden_params(v)
    if not outside.params and not outside.crashed:
        return []
    broken = v.find_unused and not v.static_graph
    return [
        Finding(
            code=Code.USED_OUTSIDE_FORWARD,
            severity="error" if broken else "info",
            labels=flag_labels(v.find_unused, v.static_graph),
            **outside.seen(v),
            fix="compute them inside the wrapped module's forward"
            + (
                "."
                if has_flags(v, static_graph=True, find_unused_parameters=False)
                else "; or, if the used set is stable, "
                + with_flags(v, static_graph=True, find_unused_parameters=False)
                + "."
            ),
        )
    ]


@detects(Code.REENTRANT_CHECKPOINT)
def reentrant_checkpoint(v: View) -> list[Finding]:
    _, reentrant = hidden_params(v)
    sites = v.blocked_checkpoints
    if sites and v.steps:
        _, blocked = v.unused_by_cause()
        return [
            Finding(
                code=Code.REENTRANT_CHECKPOINT,
                sites=lines_of(*sites),
                severity="error",
                labels={"kind": "no-grad-inputs"},
                params=v.params(blocked),
                ranks=all_ranks(v),
                steps=list(range(v.steps)),
                fix="pass use_reentrant=False to the checkpoint call at " + ", ".join(sites) + ".",
            )
        ]
    if not reentrant.ranks:
        return []
    broken = v.find_unused and not v.static_graph
    return [
        Finding(
            code=Code.REENTRANT_CHECKPOINT,
            sites=lines_of(*sites),
            severity="error" if broken else "info" if v.static_graph else "warning",
            labels=flag_labels(v.find_unused, v.static_graph),
            **reentrant.seen(v),
            fix="pass use_reentrant=False to torch.utils.checkpoint.checkpoint (it composes with DDP)"
            + (
                "."
                if has_flags(v, static_graph=True, find_unused_parameters=False)
                else ", or " + with_flags(v, static_graph=True, find_unused_parameters=False) + "."
            ),
        )
    ]
