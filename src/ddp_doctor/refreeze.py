"""refreeze: change which parameters train in the middle of a DDP run, correctly.

DDP's reducer fixes the set of parameters it all-reduces when DDP is built. Setting `requires_grad` afterwards
either keeps communicating frozen parameters, leaves a step's reduction unfinished (and the next forward raises),
or never synchronizes an unfrozen parameter (measured on torch 2.13: `tests/test_refreeze.py`). The fix is to build
a new DDP over the same module; `refreeze` does that with the same constructor arguments, keeps the parameters
(so the optimizer and its state are untouched) and first checks, across ranks, that the replicas are still
identical, since a rebuild is where a divergence would otherwise be papered over.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor import _log
from ddp_doctor._collective import agree, arrive, comm_device, layout_hash
from ddp_doctor._compat import (
    DDP_ARGUMENTS,
    HAS_FORWARD_SYNC_BUFFERS,
    HAS_INIT_SYNC,
    ddp_logging_data,
    ddp_syncs_buffers,
    parameters_to_ignore,
)
from ddp_doctor.errors import (
    DoctorError,
    InvalidArgumentError,
    NotDDPModelError,
    NoTrainableParametersError,
    RankMismatchError,
    ReplicaDivergenceError,
    StaleModelError,
)
from ddp_doctor._guard import GUARD_ATTR
from ddp_doctor.hookutil import user_site
from ddp_doctor.replicas import Entry, compare_replicas, describe
from ddp_doctor.wrapstate import require_ddp, require_process_group

__all__ = ["ParamSpec", "ProgressiveFreeze", "constructor_kwargs", "progressive_freeze", "refreeze"]

logger = _log.get_logger(__name__)

ParamSpec = (str | nn.Module | nn.Parameter | Callable[[str, nn.Parameter], bool]
             | Iterable[str | nn.Module | nn.Parameter])
"""What `freeze=` and `unfreeze=` accept: a parameter or module name (``"encoder.layers.0"``), a submodule, a
parameter, a predicate ``(name, param) -> bool``, or an iterable of names, modules and parameters."""

_calls = itertools.count()


def refreeze(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None, *,
             freeze: ParamSpec | None = None, unfreeze: ParamSpec | None = None,
             timeout: float = 300.0) -> DistributedDataParallel:
    """Rebuild DDP for a new trainable set, keeping the parameters and the optimizer state.

    Collective: call it on every rank, between optimizer steps (not inside ``no_sync()``). With neither `freeze`
    nor `unfreeze`, it rebuilds DDP for the `requires_grad` flags the parameters have now.

    What it does, in order:

    1. Resolves `freeze` and `unfreeze` to parameters and checks, across ranks, that every rank resolved the same
       set (and that every rank's arguments were valid, so a bad argument raises on every rank, not one).
    2. Compares a fingerprint of every parameter (and of its optimizer state, when `optimizer` is given) across
       ranks. If any differ, it raises `ReplicaDivergenceError` naming them: rebuilding would otherwise adopt
       rank 0's weights (DDP's constructor broadcasts them) and hide the divergence.
    3. Sets `requires_grad`, drops the stale `.grad` of newly frozen parameters (so the optimizer skips them, as
       if they had been frozen from the start), and builds a new DDP over the same module with the same
       constructor arguments (`constructor_kwargs`) and the same comm hooks. The new DDP skips the initial
       broadcast (step 2 proved it would change nothing).
    4. Retires the old DDP: calling it raises `StaleModelError`. A `guard` on the old DDP moves to the new one.

    Args:
        ddp_model: the `DistributedDataParallel` to replace.
        optimizer: the optimizer that trains the module. Its parameters and state are not changed; it is used to
            include the optimizer state in the cross-rank comparison, and to check that every unfrozen parameter
            is one the optimizer updates.
        freeze: parameters to freeze (see `ParamSpec`).
        unfreeze: parameters to unfreeze (see `ParamSpec`).
        timeout: seconds to wait for the other ranks to call `refreeze` too.

    Returns:
        The new `DistributedDataParallel`. Use it from now on: ``ddp_model = refreeze(ddp_model, opt, ...)``.

    Raises:
        NotDDPModelError: `ddp_model` is not a `DistributedDataParallel`.
        ProcessGroupNotInitializedError: `torch.distributed` is not initialized.
        InvalidArgumentError: an unknown name, a module that is not part of the model, a parameter both frozen
            and unfrozen, an unfrozen parameter the optimizer does not update, a call inside ``no_sync()``, or a
            DDP feature refreeze cannot carry over (mixed precision, delayed all-reduce, a built-in comm hook).
        NoTrainableParametersError: nothing would be left to train.
        RankMismatchError: the ranks resolved different parameters, or another rank's arguments were invalid.
        ReplicaDivergenceError: the replicas already differ; nothing was changed.
        ReportTimeoutError: a rank did not call `refreeze` within `timeout` seconds.

    Example:
        >>> ddp_model = ddp_doctor.refreeze(ddp_model, opt, freeze=["embed", "blocks.0"])
        >>> ddp_model = ddp_doctor.refreeze(ddp_model, opt, freeze=lambda name, p: name.startswith("encoder."))
    """
    require_ddp(ddp_model, "refreeze()", module_hint="Pass the DistributedDataParallel wrapper, not the module "
                                                     "inside it.")
    require_process_group("refreeze()")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__qualname__}.")

    module = ddp_model.module
    group = ddp_model.process_group
    named = list(module.named_parameters())
    ignore = parameters_to_ignore(ddp_model)
    device = comm_device(group, named[0][1].device if named else None)

    # 1. Resolve locally; any error is shared with the other ranks before anything changes.
    problem: DoctorError | None = None
    target: list[bool] = [p.requires_grad for _, p in named]
    kwargs: dict[str, Any] = {}
    try:
        kwargs = constructor_kwargs(ddp_model)
        target = _target_flags(ddp_model, named, optimizer, freeze, unfreeze)
    except DoctorError as exc:
        problem = exc
    arrive(f"refreeze/{next(_calls)}", group=group, timeout=timeout, call="refreeze()",
           fix="call it on every rank of the DDP's process group, at the same step, with the same arguments.")
    layout = layout_hash([f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named])
    plan = layout_hash([n for (n, _), t in zip(named, target) if t])
    headers = agree(
        [len(named), layout, plan], failed=int(problem is not None), group=group, device=device,
        what="refreeze() resolved a different model or a different trainable set on the ranks",
        cause="names, shapes or the selected parameters", describe=lambda h: f"{int(h[0])} params",
        fix="A predicate or name list must select the same parameters on every rank; nothing was changed.")
    if headers is not None:          # some rank's arguments were invalid: every rank raises
        if problem is not None:
            raise problem
        raise RankMismatchError(
            f"refreeze() was rejected on rank(s) {headers.failed} (their error names the argument); nothing was "
            "changed on any rank. Pass the same valid freeze=/unfreeze= on every rank.")

    # 2. The replicas must still be identical: a rebuild is not the place to adopt rank 0's weights silently.
    entries = [Entry(n, "param", p.numel(), p) for n, p in named if n not in ignore]
    if optimizer is not None:
        entries += [Entry(f"{n} (optimizer state)", "optimizer-state", p.numel(), _state_tensors(optimizer, p))
                    for n, p in named if n not in ignore]
    comparison = compare_replicas(entries, group=group, device=device)
    if comparison.differences:
        diffs = comparison.differences
        ranks = sorted({r for d in diffs for r in d.ranks})
        raise ReplicaDivergenceError(
            f"refreeze() refuses to rebuild DDP: {len(diffs)} tensor(s) already differ across ranks:\n"
            f"{describe(diffs)}\nA rebuild would make every rank adopt rank {diffs[0].reference_rank}'s copy and "
            "hide this. Nothing was changed. Find the cause first (ddp_doctor.guard or observe name it: a "
            "bypassed DDP wrapper, a requires_grad change after wrapping); then restart from a checkpoint saved "
            "before the divergence, or broadcast rank 0's weights knowingly and call refreeze again.",
            params=[d.name for d in diffs], ranks=ranks, max_difference=max(d.gap for d in diffs))

    # 3. Rebuild.
    before = [p.requires_grad for _, p in named]
    for (_, p), t in zip(named, target):
        p.requires_grad_(t)
    try:
        new = DistributedDataParallel(module, **kwargs)
    except BaseException:
        for (_, p), t in zip(named, before):
            p.requires_grad_(t)
        raise
    for (_, p), was, now in zip(named, before, target):
        if was and not now:
            p.grad = None  # a zero (not None) grad would keep Adam's momentum and weight decay moving it
    for hook, state in getattr(ddp_model, "_comm_hooks", []):
        new.register_comm_hook(state, hook)
    if hasattr(ddp_model, "_ddp_sink_clone"):
        new._ddp_sink_clone = ddp_model._ddp_sink_clone

    # 4. Retire the old wrapper and move a guard along.
    _retire(ddp_model, user_site())
    watcher = getattr(ddp_model, GUARD_ATTR, None)
    if watcher is not None and watcher.active:
        watcher.follow(new)
    if _log.is_rank_zero():
        frozen = sum(1 for w, t in zip(before, target) if w and not t)
        unfrozen = sum(1 for w, t in zip(before, target) if t and not w)
        synced = [p for (n, p), t in zip(named, target) if t and n not in ignore]
        logger.info("refreeze: froze %d and unfroze %d parameter tensor(s); DDP now reduces %d tensors (%.1f MB).",
                    frozen, unfrozen, len(synced), sum(p.numel() * p.element_size() for p in synced) / 2**20)
    return new


def constructor_kwargs(ddp_model: DistributedDataParallel) -> dict[str, Any]:
    """The keyword arguments that rebuild `ddp_model` as it was built, read back from the instance.

    Only arguments the installed DDP accepts are returned. ``init_sync=False`` is added: `refreeze` proves the
    replicas identical before rebuilding, so the initial broadcast would change nothing.

    Raises:
        InvalidArgumentError: the DDP uses something that cannot be carried over: `mixed_precision`, delayed
            all-reduce (`delay_all_reduce_named_params`), or a built-in comm hook.
    """
    ddp = ddp_model
    if getattr(ddp, "mixed_precision", None) is not None:
        raise InvalidArgumentError(
            "refreeze() cannot rebuild a DDP built with mixed_precision= (its hooks stay on the module). Freeze "
            "before wrapping, or rebuild DDP by hand.")
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise InvalidArgumentError(
            "refreeze() cannot rebuild a DDP built with delay_all_reduce_named_params=; rebuild it by hand.")
    logging_data = ddp_logging_data(ddp) or {}  # without it a built-in hook cannot be detected
    hook_name = str(logging_data.get("comm_hook", "") or "")
    if hook_name and not getattr(ddp, "_comm_hooks", None):
        raise InvalidArgumentError(
            f"refreeze() cannot carry over the built-in comm hook {hook_name!r}. Register it with "
            "ddp.register_comm_hook(state, hook) (for example default_hooks.fp16_compress_hook) instead.")

    accepted = DDP_ARGUMENTS
    kw: dict[str, Any] = {
        "device_ids": list(ddp.device_ids) if ddp.device_ids else None,
        "output_device": ddp.output_device,
        "dim": ddp.dim,
        "find_unused_parameters": bool(ddp.find_unused_parameters),
        "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
        "static_graph": bool(ddp.static_graph),
    }
    if getattr(ddp, "device_mesh", None) is not None:
        kw["device_mesh"] = ddp.device_mesh
    else:
        kw["process_group"] = ddp.process_group
    caps = list(getattr(ddp, "bucket_bytes_cap_list", []) or [])
    if caps and "bucket_cap_mb_list" in accepted:
        kw["bucket_cap_mb_list"] = [c / 2**20 for c in caps]
    elif not getattr(ddp, "bucket_bytes_cap_default", False):
        kw["bucket_cap_mb"] = ddp.bucket_bytes_cap / 2**20
    kw["forward_sync_buffers" if HAS_FORWARD_SYNC_BUFFERS else "broadcast_buffers"] = ddp_syncs_buffers(ddp)
    for name in ("skip_all_reduce_unused_params", "batched_grad_copy"):
        if name in accepted and hasattr(ddp, name):
            kw[name] = getattr(ddp, name)
    if HAS_INIT_SYNC:
        kw["init_sync"] = False
    return {k: v for k, v in kw.items() if k in accepted}


# ---------------------------------------------------------------------------------------------- resolution


def _target_flags(ddp: DistributedDataParallel, named: list[tuple[str, nn.Parameter]],
                  optimizer: torch.optim.Optimizer | None, freeze: ParamSpec | None,
                  unfreeze: ParamSpec | None) -> list[bool]:
    if not ddp.require_backward_grad_sync:
        raise InvalidArgumentError(
            "refreeze() was called inside no_sync() (require_backward_grad_sync=False), in the middle of gradient "
            "accumulation. Call it between optimizer steps.")
    module = ddp.module
    to_freeze = resolve(module, freeze, "freeze")
    to_unfreeze = resolve(module, unfreeze, "unfreeze")
    both = sorted(to_freeze & to_unfreeze)
    if both:
        raise InvalidArgumentError(f"these parameters are both in freeze= and unfreeze=: {both[:8]}. Pick one.")
    target = [(p.requires_grad or n in to_unfreeze) and n not in to_freeze for n, p in named]
    ignore = parameters_to_ignore(ddp)
    if not any(t for (n, _), t in zip(named, target) if n not in ignore):
        raise NoTrainableParametersError(
            f"after refreeze() none of the {len(named)} parameters would require a gradient, so there is nothing "
            "for DDP to synchronize. Unfreeze something, or stop using DDP for this phase.")
    if optimizer is not None:
        known = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for (n, p), t in zip(named, target) if t and not p.requires_grad and id(p) not in known]
        if missing:
            raise InvalidArgumentError(
                f"refreeze() would unfreeze {missing[:8]}{' ...' if len(missing) > 8 else ''}, but the optimizer "
                "does not update them, so they would never train. Add them first: "
                "optimizer.add_param_group({'params': [...]}) with the parameters of those modules.")
    return target


def resolve(module: nn.Module, spec: ParamSpec | None, what: str = "freeze") -> set[str]:
    """Parameter names (as `module.named_parameters()` gives them) selected by `spec`.

    Raises:
        InvalidArgumentError: an unknown name (with close matches), a module or parameter that is not part of
            `module`, an unsupported type, or a spec that selects nothing.
    """
    if spec is None:
        return set()
    named = list(module.named_parameters())
    by_id = {id(p): n for n, p in named}
    if isinstance(spec, nn.Parameter):
        items: list[Any] = [spec]
    elif isinstance(spec, (str, nn.Module)):
        items = [spec]
    elif callable(spec):
        selected = {n for n, p in named if spec(n, p)}
        if not selected:
            raise InvalidArgumentError(f"{what}={spec!r} selected no parameter of the model.")
        return selected
    elif isinstance(spec, Iterable):
        items = list(spec)
    else:
        raise InvalidArgumentError(
            f"{what}= must be a name, a module, a parameter, a predicate (name, param) -> bool, or a list of "
            f"names, modules and parameters; got {type(spec).__qualname__}.")
    modules = dict(module.named_modules())
    module_ids = {id(m): n for n, m in modules.items()}
    out: set[str] = set()
    for item in items:
        if isinstance(item, nn.Parameter):
            if id(item) not in by_id:
                raise InvalidArgumentError(
                    f"{what}= got a parameter of shape {tuple(item.shape)} that is not part of the DDP model.")
            out.add(by_id[id(item)])
        elif isinstance(item, nn.Module):
            if id(item) not in module_ids:
                raise InvalidArgumentError(
                    f"{what}= got a {type(item).__qualname__} that is not a submodule of the DDP model "
                    f"({type(module).__qualname__}).")
            out |= _params_of(item, by_id, what, module_ids[id(item)])
        elif isinstance(item, str):
            if item in dict(named):
                out.add(item)
            elif item in modules:
                out |= _params_of(modules[item], by_id, what, item)
            else:
                close = difflib.get_close_matches(item, [n for n in modules if n] + [n for n, _ in named], n=3)
                raise InvalidArgumentError(
                    f"{what}= names {item!r}, which is neither a parameter nor a module of the model."
                    + (f" Did you mean {', '.join(map(repr, close))}?" if close else
                       " See model.named_modules() for the names."))
        else:
            raise InvalidArgumentError(
                f"{what}= items must be names, modules or parameters; got {type(item).__qualname__}.")
    return out


def _params_of(sub: nn.Module, by_id: dict[int, str], what: str, label: str) -> set[str]:
    names = {by_id[id(p)] for p in sub.parameters() if id(p) in by_id}
    if not names:
        raise InvalidArgumentError(f"{what}= names module {label!r}, which has no parameters.")
    return names


def _state_tensors(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> list[torch.Tensor] | None:
    state = optimizer.state.get(p)
    if not state:
        return None
    out = []
    for key in sorted(state, key=str):
        v = state[key]
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(torch.tensor(float(v), dtype=torch.float64))
    return out or None


def _retire(old: DistributedDataParallel, site: str | None) -> None:
    """Make the replaced DDP inert and loud: its reducer's hooks go, and calling it raises."""
    try:
        old._remove_autograd_hooks()
    except Exception as exc:  # noqa: BLE001  (private API; the new reducer works either way, its hooks are its own)
        logger.debug("could not remove the old reducer's hooks: %s", exc)
    where = f" at {site}" if site else ""

    def stale(_module: nn.Module, _args: Any) -> None:
        raise StaleModelError(
            f"this DistributedDataParallel was replaced by ddp_doctor.refreeze(){where}; its reducer no longer "
            "synchronizes anything. Use the model refreeze returned: ddp_model = ddp_doctor.refreeze(ddp_model, "
            "optimizer, ...).")

    old.register_forward_pre_hook(stale)


# ------------------------------------------------------------------------------------------ progressive_freeze


Schedule = Mapping[int, str | Sequence[str]]


def progressive_freeze(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None, *,
                       freeze: Schedule | None = None, unfreeze: Schedule | None = None) -> ProgressiveFreeze:
    """Freeze (or unfreeze) modules gradually, on a schedule of steps or epochs, rebuilding DDP each time.

    Args:
        ddp_model: the current `DistributedDataParallel`.
        optimizer: passed on to `refreeze`.
        freeze: ``{step: names}``: from `step` on, these modules (or parameters) are frozen.
        unfreeze: ``{step: names}``: from `step` on, these are trainable (gradual unfreezing).

    Returns:
        A `ProgressiveFreeze`. Call ``ddp_model = schedule.update(step)`` at the top of every step (or epoch),
        with the same `step` on every rank; it rebuilds only when an entry is due.

    Raises:
        InvalidArgumentError: a key that is not a non-negative int, an unknown name (checked now, not at the
            step), or a name that is frozen and unfrozen at the same key.

    Example:
        >>> schedule = ddp_doctor.progressive_freeze(ddp_model, opt, freeze={2: ["embed"], 4: ["blocks.0"]})
        >>> for epoch in range(epochs):
        ...     ddp_model = schedule.update(epoch)   # rebuilds at epochs 2 and 4; resuming at 5 applies both
        ...     train_one_epoch(ddp_model)
    """
    return ProgressiveFreeze(ddp_model, optimizer, freeze=freeze, unfreeze=unfreeze)


class ProgressiveFreeze:
    """A freezing schedule on top of `refreeze`. See `progressive_freeze`.

    Attributes:
        model: the DDP to train now (the latest one `update` built).
        applied: the schedule keys applied so far, in order.
    """

    def __init__(self, ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer | None = None, *,
                 freeze: Schedule | None = None, unfreeze: Schedule | None = None) -> None:
        if not isinstance(ddp_model, DistributedDataParallel):
            raise NotDDPModelError(
                f"progressive_freeze() needs a DistributedDataParallel model, got {type(ddp_model).__qualname__}.")
        if not freeze and not unfreeze:
            raise InvalidArgumentError(
                "progressive_freeze() needs a schedule: freeze={step: [module names]} and/or unfreeze={...}.")
        self.model = ddp_model
        self.applied: list[int] = []
        self._optimizer = optimizer
        self._entries: dict[int, list[tuple[bool, set[str]]]] = {}
        for label, schedule, trainable in (("freeze", freeze, False), ("unfreeze", unfreeze, True)):
            for key, names in (schedule or {}).items():
                if isinstance(key, bool) or not isinstance(key, int) or key < 0:
                    raise InvalidArgumentError(
                        f"{label}= keys must be non-negative ints (a step or an epoch), got {key!r}.")
                spec = [names] if isinstance(names, str) else list(names)
                self._entries.setdefault(key, []).append((trainable, resolve(ddp_model.module, spec, label)))
        for key, changes in self._entries.items():
            if len(changes) == 2 and changes[0][1] & changes[1][1]:
                raise InvalidArgumentError(
                    f"at {key}, {sorted(changes[0][1] & changes[1][1])[:8]} are both frozen and unfrozen.")

    @property
    def pending(self) -> list[int]:
        """Schedule keys not applied yet."""
        return sorted(k for k in self._entries if k not in self.applied)

    def update(self, step: int) -> DistributedDataParallel:
        """Apply every schedule entry due at or before `step`; return the DDP to train.

        Collective when an entry is due (it calls `refreeze`): call it on every rank with the same `step`.

        Raises:
            Whatever `refreeze` raises; the schedule is then left as it was.
        """
        due = [k for k in self.pending if k <= step]
        if not due:
            return self.model
        state: dict[str, bool] = {}
        for key in due:
            for trainable, names in self._entries[key]:
                for n in names:
                    state[n] = trainable
        self.model = refreeze(self.model, self._optimizer,
                              freeze=sorted(n for n, t in state.items() if not t) or None,
                              unfreeze=sorted(n for n, t in state.items() if t) or None)
        self.applied += due
        return self.model
