"""What `Session.install()` patches before any user code runs, in place (the classes stay, so `isinstance` and
pickling behave as before): DDP's constructor (the `--ddp-kwargs` overrides, the shapes DDP is about to compare, a
`Doctor` on the model it built), `destroy_process_group` (the report is made while the group still exists) and
`Optimizer.__init__` (each optimizer's creation line, for `model-not-wrapped`, and a hook that keeps the line of its
`load_state_dict`), and FSDP2's
`set_requires_gradient_sync` (where gradient sync was switched off, for `gradient-sync-off`)."""

from __future__ import annotations

import functools
import inspect
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parameter import is_lazy
from torch.optim.optimizer import Optimizer

from ddp_doctor.core.compat import FSDP2_MODULES, fsdp_module_type
from ddp_doctor.core.errors import MixedParallelismError
from ddp_doctor.core.frames import user_frame, user_site
from ddp_doctor.core.rankfiles import WrapShapes, write_wrap
from ddp_doctor.doctor import Doctor
from ddp_doctor.doctor.plain_watch import PlainOptimizerWatch
from ddp_doctor.doctor.sharded_report import IGNORED_ATTR, SHARD_CALL_ATTR, SYNC_OFF_ATTR, record_creation_site
from ddp_doctor.launch.config import DESTROYED
from ddp_doctor.launch.import_hooks import when_imported
from ddp_doctor.launch.inflight import BUILT_AT
from ddp_doctor.launch.policy import RunPolicy
from ddp_doctor.observation.optimizers import note_loads

__all__ = [
    "PatchedRun",
    "patch_ddp_init",
    "patch_destroy_process_group",
    "patch_full_gather",
    "patch_fully_shard",
    "patch_gradient_sync",
    "patch_optimizer_init",
    "write_wrap_shapes",
]


class PatchedRun(Protocol):
    """What the patches call back: the in-rank run (`session.py`'s `Session`)."""

    rank: int
    outdir: Path
    original_init: Callable[..., None]
    signature: inspect.Signature
    policy: RunPolicy
    doctors: list[Doctor]
    plain: PlainOptimizerWatch

    @property
    def finishing(self) -> bool: ...

    def before_wrap(self, module: torch.nn.Module, arguments: dict[str, Any]) -> None: ...

    def after_wrap(self, ddp: DistributedDataParallel, trainable: list[bool], *, init_sync: bool = True) -> None: ...

    def finish(self, reason: str) -> None: ...

    def finish_unwrapped(self, reason: str) -> None: ...


def patch_ddp_init(session: PatchedRun) -> None:
    """Wrap `DistributedDataParallel.__init__`: before it, the overrides and the shapes; after it, the policy and a
    doctor (`Session.after_wrap`)."""
    original_init = session.original_init

    @functools.wraps(original_init)
    def __init__(ddp: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        bound = session.signature.bind(ddp, *args, **kwargs)
        module = bound.arguments["module"]
        if any(is_lazy(p) for p in module.parameters()):
            # DDP refuses uninitialised (lazy) parameters with its own clear error; nothing to observe before it
            return original_init(*bound.args, **bound.kwargs)
        own = [p.requires_grad for _, p in module.named_parameters()]
        session.before_wrap(module, bound.arguments)
        trainable = [p.requires_grad for _, p in module.named_parameters()]
        if not session.finishing:
            write_wrap_shapes(session.outdir, session.rank, module)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                original_init(*bound.args, **bound.kwargs)
        except Exception as exc:
            _refuse_sharded(module, exc)
            raise
        finally:
            _warn_at_caller(caught, sys._getframe(1))
        object.__setattr__(ddp, BUILT_AT, user_site())  # names its buffer broadcasts (`inflight.py`)
        if not session.finishing:
            session.policy.wrapped(ddp, own)
        # DDP keeps no trace of init_sync=False (its constructor then skips broadcasting rank 0's weights).
        session.after_wrap(ddp, trainable, init_sync=bool(bound.arguments.get("init_sync", True)))

    DistributedDataParallel.__init__ = __init__


def _warn_at_caller(caught: list[warnings.WarningMessage], caller: FrameType) -> None:
    """Re-issue DDP's constructor's warnings; one that torch pointed at its caller (this wrapper, `stacklevel=2`:
    *`broadcast_buffers` is deprecated*) points at the script's line that built DDP, as without the doctor."""
    here = __file__.removesuffix("c")
    for w in caught:
        ours = w.filename.removesuffix("c") == here
        warnings.warn_explicit(
            w.message,
            w.category,
            caller.f_code.co_filename if ours else w.filename,
            caller.f_lineno if ours else w.lineno,
            module=caller.f_globals.get("__name__") if ours else None,
            registry=caller.f_globals.setdefault("__warningregistry__", {}) if ours else None,
        )


def _refuse_sharded(module: torch.nn.Module, exc: Exception) -> None:
    """DDP's constructor failed on a model that `fully_shard` already sharded (torch 2.13: *aten.cat.default got
    mixed torch.Tensor and DTensor*, from its broadcast of rank 0's weights): say so, naming the sharded modules."""
    fsdp = fsdp_module_type()
    if fsdp is None:
        return
    sharded = [repr(name) if name else "the root" for name, m in module.named_modules() if isinstance(m, fsdp)]
    if not sharded:
        return
    names = ", ".join(sharded[:4]) + (f" and {len(sharded) - 4} more" if len(sharded) > 4 else "")
    raise MixedParallelismError(
        f"DistributedDataParallel was given a {type(module).__qualname__} whose modules {names} fully_shard "
        f"(FSDP2) already sharded; DDP cannot wrap their DTensor parameters (torch raised: {exc}). Use one "
        "data-parallel wrapper: fully_shard the blocks and then the root, and no DDP; or DDP alone, without "
        "fully_shard."
    ) from exc


def patch_destroy_process_group(session: PatchedRun) -> None:
    """The script tears its process group down before the observed steps are done: report while it exists."""
    original_destroy = dist.destroy_process_group

    @functools.wraps(original_destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        # `destroy_process_group(None)` (Accelerate's end_training()) and `(group=dist.group.WORLD)` end the
        # default group just as the no-argument form does.
        group = args[0] if args else kwargs.get("group")
        if group is None or group is dist.group.WORLD:
            if session.doctors and not session.finishing:
                session.finish(DESTROYED)
            if session.plain.steps and not session.doctors and not session.finishing:
                session.finish_unwrapped(DESTROYED)
            session.policy.torn_down(user_site())  # under `watch` the script runs on, without collectives
        return original_destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group


def patch_optimizer_init() -> None:
    original_opt_init = Optimizer.__init__

    @functools.wraps(original_opt_init)
    def optimizer_init(opt: Optimizer, *args: Any, **kwargs: Any) -> None:
        original_opt_init(opt, *args, **kwargs)
        record_creation_site(opt)
        note_loads(opt)

    Optimizer.__init__ = optimizer_init


def patch_gradient_sync() -> None:
    """Remember on each FSDP2 module where the script last switched its gradient sync off (None: back on). Waits
    for FSDP2 to be imported."""
    for name in FSDP2_MODULES:
        when_imported(name, _patch_gradient_sync)


def _patch_gradient_sync() -> None:
    fsdp = fsdp_module_type()
    if fsdp is None:
        return
    for name in ("set_requires_gradient_sync", "set_requires_all_reduce"):
        original = getattr(fsdp, name, None)
        if original is None or getattr(original, "_ddp_doctor_patched", False):
            continue
        setattr(fsdp, name, _noting_sync_off(original, name))


def _noting_sync_off(original: Callable[..., None], name: str) -> Callable[..., None]:
    """`original` (a switch of FSDP2's gradient sync), noting on the module which call switched it off, and where."""

    keyword = name.removeprefix("set_")  # the flag's parameter: requires_gradient_sync, requires_all_reduce

    @functools.wraps(original)
    def switch(module: Any, *args: Any, **kwargs: Any) -> None:
        original(module, *args, **kwargs)
        on = args[0] if args else kwargs.get(keyword, True)
        object.__setattr__(module, SYNC_OFF_ATTR, None if on else (name, user_site()))

    switch._ddp_doctor_patched = True  # type: ignore[attr-defined]
    return switch


def patch_fully_shard(reshard_off: list[int], on_shard: Callable[[str | None, Any], None]) -> None:
    """Number the script's `fully_shard` calls and remember each call's line on the modules it sharded (the
    `reshard_after_forward` advice names them) and on the parameters it was told to ignore; the calls listed in
    `reshard_off` run with `reshard_after_forward=False` (a verification run applying that advice); after each
    call, `on_shard(line, mp_policy)` (the policy as given, or None). The public
    `torch.distributed.fsdp` attribute is replaced as that package is imported, so `from torch.distributed.fsdp
    import fully_shard` in the script (or in Accelerate) reads the patched one."""
    when_imported("torch.distributed.fsdp", lambda: _patch_fully_shard(reshard_off, on_shard))


def _patch_fully_shard(reshard_off: list[int], on_shard: Callable[[str | None, Any], None]) -> None:
    fsdp_package = sys.modules.get("torch.distributed.fsdp")
    original = getattr(fsdp_package, "fully_shard", None)
    if original is None or getattr(original, "_ddp_doctor_patched", False):
        return
    calls = [0]

    @functools.wraps(original)
    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        index, calls[0] = calls[0], calls[0] + 1
        if index in reshard_off:
            kwargs["reshard_after_forward"] = False
        out = original(module, *args, **kwargs)
        site = user_site()
        for m in module if isinstance(module, (list, tuple)) else [module]:
            object.__setattr__(m, SHARD_CALL_ATTR, (index, site))
        for p in kwargs.get("ignored_params") or ():
            setattr(p, IGNORED_ATTR, site)  # FSDP2 leaves them to the script: neither sharded nor synced
        on_shard(site, kwargs.get("mp_policy"))
        return out

    fully_shard._ddp_doctor_patched = True  # type: ignore[attr-defined]
    fsdp_package.fully_shard = fully_shard


def patch_full_gather(on_gather: Callable[[FrameType], None]) -> None:
    """Call `on_gather(frame)` before each `DTensor.redistribute` from a sharded placement to another, with the
    caller's frame (the callback walks it to the user's line only when it counts the call: a tensor-parallel
    forward redistributes at every step): a collective every rank of the mesh must enter, which a
    `full_state_dict=True` save under `if rank == 0:` enters on one rank alone. Patched on the class, so
    `full_tensor` and torch's state-dict gathering (which call it) pass through it too. Waits for DTensor to be
    imported (`torch.distributed.tensor`, `torch.distributed._tensor` in 2.4)."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        when_imported(name, lambda name=name: _patch_full_gather(sys.modules[name], on_gather))


def _patch_full_gather(package: Any, on_gather: Callable[[FrameType], None]) -> None:
    DTensor = getattr(package, "DTensor", None)  # noqa: N806  (the class)
    if DTensor is None:
        return
    original = DTensor.redistribute
    if getattr(original, "_ddp_doctor_patched", False):
        return

    @functools.wraps(original)
    def redistribute(self: Any, device_mesh: Any = None, placements: Any = None, **kwargs: Any) -> Any:
        try:
            if (
                placements is not None
                and tuple(placements) != tuple(self.placements)
                and any(p.is_shard() for p in self.placements)
            ):
                on_gather(sys._getframe(1))
        except Exception:  # noqa: BLE001 -- an observation must never break the script's gather
            pass
        return original(self, device_mesh, placements, **kwargs)

    redistribute._ddp_doctor_patched = True  # type: ignore[attr-defined]
    DTensor.redistribute = redistribute  # type: ignore[method-assign]


def write_wrap_shapes(outdir: Path, rank: int, module: torch.nn.Module) -> None:
    """Leave the shapes DDP's constructor is about to compare across ranks (`param-shapes-differ`): when it
    refuses the model, a rank's error names only `params[i]` and its own sizes, and rank 0 names nothing."""
    # DDP's order: trainable parameters not ignored, shared ones once (`_build_params_for_reducer`).
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
    site = user_frame(traceback.extract_stack(), code=False)  # ddp_doctor's and torch's frames are not the user's
    write_wrap(
        outdir,
        WrapShapes(
            rank=rank,
            site=site,
            names=[n for n, _ in params],
            shapes=[list(p.shape) for _, p in params],
            torch_version=torch.__version__,
            backend=str(dist.get_backend()) if dist.is_initialized() else "",
        ),
    )
