"""What DDP was built with: its flags read back from the instance, and the requires_grad state at wrap time."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.compat import (
    DDP_ARGUMENTS,
    HAS_FORWARD_SYNC_BUFFERS,
    HAS_INIT_SYNC,
    ddp_broadcasts_buffers,
    ddp_logging_data,
    ddp_syncs_buffers,
    fsdp_module_type,
    is_sharded,
    parameters_to_ignore,
)
from ddp_doctor.core.errors import DoctorError, InvalidArgumentError, NotDDPModelError, ProcessGroupNotInitializedError
from ddp_doctor.core.frames import format_site, is_user_frame
from ddp_doctor.core.records import Flavor, ModelInfo
from ddp_doctor.observation.model_averaging import local_sgd_of

__all__ = [
    "WRAP_STATE_ATTR",
    "comm_hook_of",
    "constructor_kwargs",
    "current_flavor",
    "ddp_config_of",
    "freeze_named",
    "is_local_batchnorm",
    "model_info",
    "require_ddp",
    "require_process_group",
    "user_name",
]

_WRAP_HINT = "Wrap it first: DistributedDataParallel(model, device_ids=[local_rank])."

WRAP_STATE_ATTR = "_ddp_doctor_wrap_state"
"""Set on a DDP instance by the launcher's injection: `{"trainable": [...], "site": "file:line", "framework": ...}`."""


def user_name(name: str) -> str:
    """A parameter's name as the user's own module calls it: `torch.compile` wraps a module in an `OptimizedModule`
    whose parameters carry an `_orig_mod.` prefix (at any depth, for a compiled submodule)."""
    return name.replace("_orig_mod.", "")


def freeze_named(
    module: torch.nn.Module, names: list[str] | tuple[str, ...], *, what: str = "--ddp-kwargs freeze_before_wrap"
) -> None:
    """Set `requires_grad=False` on the named parameters of `module` (`ddp-doctor`'s freeze-before-wrap).

    The report's names drop torch.compile's `_orig_mod.` prefix; both spellings are accepted.

    Raises:
        DoctorError: a name the module does not have; the message lists the module's parameters.
    """
    named = dict(module.named_parameters())
    named.update({user_name(n): p for n, p in list(named.items())})
    missing = [n for n in names if n not in named]
    if missing:
        raise DoctorError(
            f"{what} names parameters this model does not have: {missing}. "
            f"Its parameters are: {list(named)[:20]}{' ...' if len(named) > 20 else ''}"
        )
    for name in names:
        named[name].requires_grad_(False)


def ddp_config_of(ddp: DistributedDataParallel) -> dict[str, Any]:
    """The constructor flags that matter for diagnosis, read back from a built DDP instance."""
    return {
        "find_unused_parameters": bool(ddp.find_unused_parameters),
        "static_graph": bool(ddp.static_graph),
        "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
        "broadcast_buffers": ddp_syncs_buffers(ddp),
        "bucket_cap_mb": round(ddp.bucket_bytes_cap / 2**20, 3),
        "device_ids": list(ddp.device_ids) if ddp.device_ids else None,
    }


def model_info(
    ddp: DistributedDataParallel, named_params: list[tuple[str, torch.nn.Parameter]], buffers: list[torch.Tensor]
) -> ModelInfo:
    """The model's parameter layout and the trainable set DDP was built with.

    Exact when the launcher stamped `WRAP_STATE_ATTR` on the instance; otherwise the state at observe() entry
    stands in, checked against the tensor count and byte size DDP's logging data recorded at construction.
    """
    module = ddp.module
    params = [p for _, p in named_params]
    ignore = parameters_to_ignore(ddp)
    names = [n for n, _ in named_params]
    ignored = [n in ignore for n in names]
    state = getattr(ddp, WRAP_STATE_ATTR, None)
    logging_data = ddp_logging_data(ddp)
    wrap_count: int | None = None if logging_data is None else int(logging_data.get("num_parameter_tensors", -1))
    wrap_bytes = -1 if logging_data is None else int(logging_data.get("total_parameter_size_bytes", -1))
    if state is not None and len(state["trainable"]) == len(names):
        trainable = [t and not ig for t, ig in zip(state["trainable"], ignored)]
        exact = True
    else:
        # Not built under our launcher: the state at observe() entry stands in for the state at wrap time.
        # DDP's logging data tells how many tensors its reducer holds, which catches a flip in between.
        trainable = [p.requires_grad and not ig for p, ig in zip(params, ignored)]
        exact = wrap_count is None or wrap_count < 0 or wrap_count == sum(trainable)
        if not exact and wrap_count is not None and wrap_count > sum(trainable):
            # Fewer trainable tensors now than DDP was built with. If every currently frozen parameter is
            # needed to make up both the count and the byte size DDP recorded, they were all frozen after wrap.
            frozen = [i for i, (t, ig) in enumerate(zip(trainable, ignored)) if not t and not ig]
            nbytes = sum(p.numel() * p.element_size() for p, t in zip(params, trainable) if t)
            extra = sum(params[i].numel() * params[i].element_size() for i in frozen)
            if len(frozen) == wrap_count - sum(trainable) and nbytes + extra == wrap_bytes:
                for i in frozen:
                    trainable[i] = True
                exact = True
    config = ddp_config_of(ddp)
    if state is not None and state.get("init_sync") is False:
        config["init_sync"] = False  # only when set: DDP keeps no trace of it, the launcher's wrap saw it
    return ModelInfo(
        param_names=[user_name(n) for n in names],
        param_shapes=[tuple(p.shape) for p in params],
        trainable_at_wrap=trainable,
        ignored=ignored,
        buffer_names=[user_name(n) for n, _ in module.named_buffers()],
        buffer_shapes=[tuple(b.shape) for b in buffers],
        ddp_config=config,
        buffers_synced=ddp_broadcasts_buffers(ddp),
        device_type=str(getattr(ddp, "device_type", "") or ""),
        wrap_state_exact=exact,
        wrap_trainable_count=wrap_count if wrap_count is not None and wrap_count >= 0 else None,
        ddp_site=state.get("site") if state else None,
        framework=state.get("framework", "torch") if state else "torch",
        batchnorm=[user_name(n) for n, m in module.named_modules() if is_local_batchnorm(m)],
        flavor=current_flavor(),
    )


def comm_hook_of(ddp: DistributedDataParallel) -> dict[str, Any] | None:
    """The comm hook registered on `ddp` (`register_comm_hook`, or a built-in one): `name`, `site` where the
    script defines it (None for torch's own hooks), and for torch's `post_localSGD_hook` its `local_sgd` state
    (`observation/model_averaging.py`). None: DDP all-reduces its buckets itself."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if not hooks:
        name = str((ddp_logging_data(ddp) or {}).get("comm_hook", "") or "")
        return {"name": name, "site": None} if name else None
    hook, state = hooks[-1]
    func = getattr(hook, "func", hook)  # a functools.partial
    code = getattr(func, "__code__", None)
    site = None
    if code is not None and is_user_frame(code.co_filename):
        site = format_site(code.co_filename, code.co_firstlineno)
    found: dict[str, Any] = {"name": getattr(func, "__qualname__", type(hook).__name__), "site": site}
    local = local_sgd_of(hook, state, ddp.process_group.size() if ddp.process_group is not None else None)
    if local is not None:
        found["local_sgd"] = local
    return found


def is_local_batchnorm(module: torch.nn.Module) -> bool:
    """A BatchNorm layer whose statistics come from this rank's batch alone (not SyncBatchNorm)."""
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, torch.nn.SyncBatchNorm)


def current_flavor() -> Flavor:
    """The framework versions imported in this process (where the model is built): what fixes are phrased for."""
    module = sys.modules.get("transformers.training_args")
    fields = getattr(getattr(module, "TrainingArguments", None), "__dataclass_fields__", None)
    only_pl = "pytorch_lightning" in sys.modules and "lightning" not in sys.modules
    return Flavor(
        lightning_package="pytorch_lightning" if only_pl else "lightning.pytorch",
        transformers_version=str(getattr(sys.modules.get("transformers"), "__version__", "")),
        training_arguments_fields=sorted(f for f in fields if f.startswith("ddp_")) if fields is not None else None,
    )


def require_ddp(model: Any, caller: str, *, module_hint: str = _WRAP_HINT) -> None:
    """Raise `NotDDPModelError` naming `caller` and the type received unless `model` is a DDP instance.

    Args:
        model: what the user passed.
        caller: the public function's name, for the message (``"observe()"``).
        module_hint: the fix to add when `model` is a plain `nn.Module`.
    """
    if isinstance(model, DistributedDataParallel):
        return
    if is_sharded(model):
        # Never the DDP wrap: DDP around a sharded model fails in its constructor (a bad input `check` names).
        # fully_shard makes the root an instance of a class of its own (FSDPSequential): the user's is its base.
        fsdp = fsdp_module_type()
        cls = next(c for c in type(model).__mro__ if fsdp is None or not issubclass(c, fsdp))
        raise NotDDPModelError(
            f"{caller} watches DistributedDataParallel models; the {cls.__module__}.{cls.__qualname__} given "
            "is sharded with FSDP2 (fully_shard or replicate), so do not wrap it in DDP as well. "
            "`ddp_doctor.observe(model, optimizer=opt)` and `ddp-doctor check --nproc-per-node N train.py` follow "
            "FSDP2 and replicate jobs."
        )
    hint = f" {module_hint}" if isinstance(model, torch.nn.Module) else ""
    raise NotDDPModelError(
        f"{caller} needs a torch.nn.parallel.DistributedDataParallel model, got "
        f"{type(model).__module__}.{type(model).__qualname__}.{hint}"
    )


def require_process_group(caller: str, *, launchers: str = "torchrun") -> None:
    """Raise `ProcessGroupNotInitializedError` naming `caller` unless torch.distributed is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupNotInitializedError(
            f"{caller} needs an initialized process group: call torch.distributed.init_process_group(backend) "
            f"first, or launch the script with {launchers}."
        )


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
            "before wrapping, or rebuild DDP by hand."
        )
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise InvalidArgumentError(
            "refreeze() cannot rebuild a DDP built with delay_all_reduce_named_params=; rebuild it by hand."
        )
    logging_data = ddp_logging_data(ddp) or {}  # without it a built-in hook cannot be detected
    hook_name = str(logging_data.get("comm_hook", "") or "")
    if hook_name and not getattr(ddp, "_comm_hooks", None):
        raise InvalidArgumentError(
            f"refreeze() cannot carry over the built-in comm hook {hook_name!r}. Register it with "
            "ddp.register_comm_hook(state, hook) (for example default_hooks.fp16_compress_hook) instead."
        )

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
