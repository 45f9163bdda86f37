"""refreeze: change which parameters train in the middle of a DDP run, correctly.

DDP's reducer fixes the set of parameters it all-reduces when DDP is built. Setting `requires_grad` afterwards
either keeps communicating frozen parameters, leaves a step's reduction unfinished (and the next forward raises),
or never synchronizes an unfrozen parameter (measured on torch 2.13: `tests/fixes/test_refreeze.py`). The fix is to build
a new DDP over the same module; `refreeze` does that with the same constructor arguments, keeps the parameters
(so the optimizer and its state are untouched) and first checks, across ranks, that the replicas are still
identical (`preflight`), since a rebuild is where a divergence would otherwise be papered over.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core import log as _log
from ddp_doctor.core.compat import parameters_to_ignore
from ddp_doctor.core.errors import DoctorError, InvalidArgumentError, StaleModelError
from ddp_doctor.core.frames import user_site
from ddp_doctor.exchange.primitives import comm_device
from ddp_doctor.fixes.guard import GUARD_ATTR
from ddp_doctor.fixes.refreeze.preflight import agree_on_plan, require_identical_replicas
from ddp_doctor.fixes.refreeze.select import ParamSpec, target_flags
from ddp_doctor.observation.wrapstate import constructor_kwargs, require_ddp, require_process_group

__all__ = ["refreeze"]

logger = logging.getLogger("ddp_doctor.refreeze")


def refreeze(
    ddp_model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    freeze: ParamSpec | None = None,
    unfreeze: ParamSpec | None = None,
    timeout: float = 300.0,
) -> DistributedDataParallel:
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
    require_ddp(
        ddp_model, "refreeze()", module_hint="Pass the DistributedDataParallel wrapper, not the module inside it."
    )
    require_process_group("refreeze()")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__qualname__}."
        )

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
        target = target_flags(ddp_model, named, optimizer, freeze, unfreeze)
    except DoctorError as exc:
        problem = exc
    agree_on_plan(named, target, problem, group=group, device=device, timeout=timeout)

    # 2. The replicas must still be identical: a rebuild is not the place to adopt rank 0's weights silently.
    require_identical_replicas(named, ignore, optimizer, group=group, device=device)

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
        logger.info(
            "refreeze: froze %d and unfroze %d parameter tensor(s); DDP now reduces %d tensors (%.1f MB).",
            frozen,
            unfrozen,
            len(synced),
            sum(p.numel() * p.element_size() for p in synced) / 2**20,
        )
    return new


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
            "optimizer, ...)."
        )

    old.register_forward_pre_hook(stale)
