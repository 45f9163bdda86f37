"""refreeze: change which parameters train in the middle of a DDP run, correctly.

DDP's reducer fixes the set of parameters it all-reduces when DDP is built. Setting `requires_grad` afterwards
either keeps communicating frozen parameters, leaves a step's reduction unfinished (and the next forward raises),
or never synchronizes an unfrozen parameter (measured on torch 2.13: `tests/test_refreeze.py`). The fix is to build
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

from ddp_doctor import _log
from ddp_doctor._collective import comm_device
from ddp_doctor._compat import (
    DDP_ARGUMENTS,
    HAS_FORWARD_SYNC_BUFFERS,
    HAS_INIT_SYNC,
    ddp_logging_data,
    ddp_syncs_buffers,
    parameters_to_ignore,
)
from ddp_doctor._guard import GUARD_ATTR
from ddp_doctor._refreeze.preflight import agree_on_plan, require_identical_replicas
from ddp_doctor._refreeze.select import ParamSpec, target_flags
from ddp_doctor.errors import DoctorError, InvalidArgumentError, StaleModelError
from ddp_doctor.hookutil import user_site
from ddp_doctor.wrapstate import require_ddp, require_process_group

__all__ = ["constructor_kwargs", "refreeze"]

logger = logging.getLogger("ddp_doctor.refreeze")


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
