"""What the exchange compared across the ranks, with counts: the claim a report may make, and nothing more.

A report without findings says "No problems found" only about what is listed here (`Diagnosis.compared`, JSON key
`compared`, drawn by `report/`): the steps every rank completed, the parameters DDP registered (weights before and
after each step, gradients where the optimizer used them, `requires_grad`), the parameters the module tree held
beyond them, the buffers DDP registered, every module's train/eval mode, each step's inputs, the optimizer's
settings at each step it took, the batches each step drew from the training loader and the ranks' samplers, the
script's own collectives in order, and per step DDP's synced backward passes and
buffer broadcasts. Anything the check could not compare goes to `unchecked`.
"""

from __future__ import annotations

from typing import Any

from ddp_doctor.core.codes import not_checked_for
from ddp_doctor.core.findings import Unchecked
from ddp_doctor.core.summary import Summary

__all__ = ["compared", "not_read", "unreadable"]

_GRADS_AT = {"step": "optimizer.step()", "closure": "the end of optimizer.step()", "backward": "the synced backward"}


def compared(summary: Summary) -> dict[str, Any]:
    """The counts of what the exchange compared across the ranks (pure: from the `Summary`)."""
    s, info = summary.steps, summary.info
    ignored = sum(info.ignored)
    hi, lo = summary.collectives
    agreed = bool((hi[:s, 0] == lo[:s, 0]).all()) if s else True
    measured = {k: n for k, n in summary.grads_measured.items() if n}
    grads_at = _GRADS_AT[max(measured, key=measured.get)] if measured else None
    buffers = int(summary.buffer_seen.all(0).sum()) if s and summary.buffer_seen.numel() else 0
    stepped = sum(1 for v in summary.steps_taken[1][:s] if v)
    meta = summary.metas.get(0, {})
    unread = meta.get("unreadable") or []
    return {
        "ranks": summary.world,
        "steps": s,
        "parameters": len(info.param_names) - ignored,
        "ignored_by_ddp": ignored,
        "created_after_wrap": max(summary.unregistered[:s], default=0),
        # Trainable tensors the optimizer steps beside the model (a loss temperature), values and gradients.
        "outside_model": int(meta.get("outside_count") or len(meta.get("outside") or [])),
        "gradients_at": grads_at,
        "buffers": buffers,
        "buffers_not_recorded": len(info.buffer_names) - buffers,
        # When DDP does not broadcast buffers, those registered under a new name after the wrap (8 are named).
        "buffers_after_wrap": int(meta.get("late_count") or len(meta.get("late_buffers") or []))
        - sum(1 for e in unread if e["kind"] == "buffer"),
        "unreadable": len(unread),
        "modules": int(summary.metas.get(0, {}).get("modules", 0)),
        "modules_beside": _beside(summary),
        "inputs": int(summary.input_present[:s].sum()) if s else 0,
        "batches_drawn": sum(1 for k, v in enumerate(summary.drawn[1][:s]) if v > 0 and summary.steps_taken[1][k]),
        "samplers": summary.sampler_compared,
        "optimizer_steps": stepped,
        "collectives": int(hi[:s, 0].sum()) if s and agreed else None,
        "collectives_per_rank_differ": not agreed,
        "codes_not_checked": [str(c) for c in not_checked_for("ddp")],
    }


def _beside(summary: Summary) -> int:
    """Modules the script calls outside DDP's forward (a distillation teacher) whose weights and buffers were
    compared: those every rank called (when the ranks' module state differs, the example ranks tell which)."""
    mine = [e["name"] for e in summary.metas.get(0, {}).get("beside_modules") or []]
    odd = summary.examples["state-differs"].ranks
    held = [{e["name"] for e in summary.metas.get(r, {}).get("beside_modules") or []} for r in odd]
    return sum(all(name in h for h in held) for name in mine)


def unreadable(summary: Summary) -> list[Unchecked]:
    """The tensors in the module tree whose values the check cannot read (a tensor subclass whose ops the fingerprint
    cannot run, as a quantized weight's; on the meta device; a lazy module's before its first forward): those beyond
    what DDP registered as rank 0 saw them at the last step, and DDP's buffers no rank recorded at any step. Their
    copies were not compared across the ranks."""
    held = [
        f"{e['kind']} {e['name']} ({e['type']}"
        + ("" if e["data"] else ", no values yet: on the meta device or lazy")
        + ")"
        for e in summary.metas.get(0, {}).get("unreadable") or []
    ]
    # The buffers DDP was built with that no rank could fingerprint at a step whose training forward the check saw
    # (DDP built with broadcast_buffers=False takes one of a subclass it could not broadcast, or holding NaN).
    s, seen = summary.steps, summary.buffer_seen
    if s and seen.numel() and bool(summary.input_present[:s].any()):
        never = (~seen[:s].any(0)).nonzero().flatten().tolist()
        held += [f"buffer {summary.info.buffer_names[i]} (no value read: a tensor subclass, or NaN)" for i in never]
    return [Unchecked("unreadable", not_read(held), {"tensors": held})] if held else []


def not_read(held: list[str]) -> str:
    """The "Not checked" sentence for tensors the check cannot read, named (with their types) in `held`; for every
    parallelism."""
    more = f" and {len(held) - 4} more" if len(held) > 4 else ""
    return (
        f"the values of {', '.join(held[:4])}{more}: the check cannot read them (a tensor subclass whose operations "
        "it cannot run, or a tensor without values), so whether the ranks' copies are equal was not compared."
    )
