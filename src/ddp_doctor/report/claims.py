"""The line of a report that says what the check compared across the ranks, with its counts, and which checks it
does not make for the model's parallelism (`ReportData.compared`): the whole of what a report without findings
claims."""

from __future__ import annotations

from typing import Any

from ddp_doctor.core.codes import PARALLELISMS

__all__ = ["compared_line"]


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


_DRAWN = "the batches each step drew from the training loader"
_SAMPLERS = "the samplers' settings (seed, shuffle, replicas, dataset length)"


def _sharded_compared_line(c: dict[str, Any]) -> str:
    """What a sharded model's report compared across the ranks (`analyze/sharded.py`'s `sharded_compared`)."""
    api, steps = c["api"], c["steps"]
    parts = [
        f"the optimizer's parameters against the model's {_n(c['parameters'], 'trainable parameter')}",
        f"which of them sit outside every {api} group ({c['outside_groups']}, their weights compared)"
        + (
            f"; {_n(c['outside_model'], 'tensor')} the optimizer steps outside the model (weights compared)"
            if c.get("outside_model")
            else ""
        ),
        "gradient sync at each optimizer step",
        "a gradient for every trainable parameter",
        "whether the weights changed",
    ]
    if c.get("replicas"):
        among = "every rank" if c.get("replica_rows") == 1 else "the ranks holding the same shard"
        parts.append(
            f"the weights of {_n(c['replicas'], 'parameter')} across {among}, after the first and the last step"
        )
    if c.get("buffers"):
        parts.append(f"{_n(c['buffers'], 'buffer')} at the last step")
    if c.get("inputs"):
        parts.append(f"the inputs ({_n(c['inputs'], 'step')})")
    if c.get("inputs_within_groups"):
        dims = "/".join(c.get("group_dims") or ["tensor-parallel"])
        parts.append(f"the inputs within each {dims} group ({_n(c['inputs_within_groups'], 'step')})")
    if c.get("batches_drawn"):
        parts.append(f"{_DRAWN} ({_n(c['batches_drawn'], 'step')})")
    if c.get("samplers"):
        parts.append(_SAMPLERS)
    if c.get("state_steps"):
        parts.append(
            f"the optimizer's settings and state, the train/eval modes of {_n(c['modules'], 'module')} and "
            f"which parameters require a gradient ({_n(c['state_steps'], 'step')})"
        )
        if c.get("collectives") is None:
            parts.append(
                f"the collectives called through torch.distributed, the script's and FSDP2's, in order (their counts "
                f"differ; {_n(c['state_steps'], 'step')})"
            )
        elif c["collectives"]:
            parts.append(
                f"{_n(c['collectives'], 'collective')} called through torch.distributed, the script's and FSDP2's, "
                f"in order ({_n(c['state_steps'], 'step')})"
            )
        else:
            parts.append(f"the collectives called through torch.distributed (none in {_n(c['state_steps'], 'step')})")
    if c.get("gradient_scale_steps"):
        parts.append(
            f"the scale of the gradient shards from the backward's end to the step ({_n(c['gradient_scale_steps'], 'step')})"
        )
    if c.get("saves"):
        parts.append(f"every torch.save of sharded state in {c['saves']}")
    if c.get("timed_steps"):
        who = "the wait for data and a straggler rank" if c.get("straggler") else "the wait for data"
        parts.append(
            f"{who} ({'the GPU' if c.get('clock') == 'gpu' else 'the host'}'s clock, {c['timed_steps']} steps)"
        )
    if c.get("all_gathers_per_step") is not None:
        parts.append(f"FSDP2's all-gathers per step ({c['all_gathers_per_step']})")
    name = "FSDP2" if c["parallelism"] == "fsdp2" else "replicate"
    return f"Compared across {c['ranks']} ranks over {_n(steps, 'optimizer step')} ({name}): {'; '.join(parts)}."


def _line(c: dict[str, Any]) -> str:
    if c.get("parallelism") in ("fsdp2", "replicate"):
        return _sharded_compared_line(c)
    if c.get("parallelism") == "none":  # no wrapper: the weights of the plain parameters the optimizer stepped
        if not c["parameters"]:
            return f"Compared across {c['ranks']} ranks: nothing (every parameter the optimizer steps is named below)."
        return (
            f"Compared across {c['ranks']} ranks after {_n(c['steps'], 'optimizer step')} (no DDP): the weights of "
            f"{_n(c['parameters'], 'parameter')} the optimizer steps."
        )
    steps = c["steps"]
    if not steps:
        return f"Compared across {c['ranks']} ranks: no step that every rank completed, so nothing step by step."
    grads = f", gradients (at {c['gradients_at']})" if c.get("gradients_at") else ""
    parts = [f"the weights{grads} and requires_grad of {_n(c['parameters'], 'parameter')} DDP syncs"]
    if c.get("created_after_wrap"):
        parts[0] += f", and {c['created_after_wrap']} created after wrap"
    if c.get("outside_model"):
        parts[0] += f"; {_n(c['outside_model'], 'tensor')} the optimizer steps outside the model"
    if c.get("modules_beside"):
        parts.append(f"the weights and buffers of {_n(c['modules_beside'], 'module')} run beside the DDP model")
    if c.get("buffers") or c.get("buffers_after_wrap"):
        late, held = c.get("buffers_after_wrap", 0), c.get("buffers", 0)
        after = f"{_n(late, 'buffer') if not held else f'and {late}'} registered after wrap" if late else ""
        parts.append(", ".join(x for x in (_n(held, "buffer") if held else "", after) if x))
    if c.get("modules"):
        parts.append(f"the train/eval modes of {_n(c['modules'], 'module')}")
    if c.get("inputs"):
        parts.append("the inputs" + ("" if c["inputs"] == steps else f" ({c['inputs']} steps)"))
    if c.get("batches_drawn"):
        drawn = "" if c["batches_drawn"] == steps else f" ({_n(c['batches_drawn'], 'step')})"
        parts.append(f"{_DRAWN}{drawn}")
    if c.get("samplers"):
        parts.append(_SAMPLERS)
    if c.get("optimizer_steps"):
        parts.append("the optimizer's settings and state (its tensors with state, their step count)")
    if c.get("collectives_per_rank_differ"):
        parts.append("the script's collectives (their counts differ)")
    elif c.get("collectives"):
        parts.append(f"{_n(c['collectives'], 'collective')} of the script's, in order")
    elif c.get("collectives") == 0:
        parts.append("the script's own collectives (none)")
    parts.append("DDP's synced backward passes and buffer broadcasts")
    return f"Compared across {c['ranks']} ranks at each of {_n(steps, 'step')}: {'; '.join(parts)}."


def compared_line(c: dict[str, Any]) -> str:
    """What the exchange compared across the ranks (`ReportData.compared`), with its counts; then the checks that
    apply to the model's parallelism and are not made for it (`codes_not_checked`), which another parallelism's
    check makes."""
    codes = c.get("codes_not_checked") or []
    if not codes:
        return _line(c)
    name = PARALLELISMS.get(c.get("parallelism", "ddp"), "this parallelism")
    others = "FSDP2's" if name == "DDP" else "DDP's"
    listed = ", ".join(f"`{code}`" for code in codes)
    return f"{_line(c)} Not checked for {name} ({others} check makes them): {listed}."
