"""Which parameters `refreeze` changes: `freeze=` and `unfreeze=` resolved to parameter names, checked locally."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.compat import parameters_to_ignore
from ddp_doctor.core.errors import InvalidArgumentError, NoTrainableParametersError

__all__ = ["ParamSpec", "resolve", "target_flags"]

ParamSpec = (
    str | nn.Module | nn.Parameter | Callable[[str, nn.Parameter], bool] | Iterable[str | nn.Module | nn.Parameter]
)
"""What `freeze=` and `unfreeze=` accept: a parameter or module name (``"encoder.layers.0"``), a submodule, a
parameter, a predicate ``(name, param) -> bool``, or an iterable of names, modules and parameters."""


def target_flags(
    ddp: DistributedDataParallel,
    named: list[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer | None,
    freeze: ParamSpec | None,
    unfreeze: ParamSpec | None,
) -> list[bool]:
    """The `requires_grad` flag each parameter of `named` gets, in order. Local: no communication.

    Raises:
        InvalidArgumentError: a call inside ``no_sync()``, a bad spec (see `resolve`), a parameter both frozen and
            unfrozen, or an unfrozen parameter `optimizer` does not update.
        NoTrainableParametersError: nothing would be left to train.
    """
    if not ddp.require_backward_grad_sync:
        raise InvalidArgumentError(
            "refreeze() was called inside no_sync() (require_backward_grad_sync=False), in the middle of gradient "
            "accumulation. Call it between optimizer steps."
        )
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
            "for DDP to synchronize. Unfreeze something, or stop using DDP for this phase."
        )
    if optimizer is not None:
        known = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for (n, p), t in zip(named, target) if t and not p.requires_grad and id(p) not in known]
        if missing:
            raise InvalidArgumentError(
                f"refreeze() would unfreeze {missing[:8]}{' ...' if len(missing) > 8 else ''}, but the optimizer "
                "does not update them, so they would never train. Add them first: "
                "optimizer.add_param_group({'params': [...]}) with the parameters of those modules."
            )
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
            f"names, modules and parameters; got {type(spec).__qualname__}."
        )
    modules = dict(module.named_modules())
    module_ids = {id(m): n for n, m in modules.items()}
    out: set[str] = set()
    for item in items:
        if isinstance(item, nn.Parameter):
            if id(item) not in by_id:
                raise InvalidArgumentError(
                    f"{what}= got a parameter of shape {tuple(item.shape)} that is not part of the DDP model."
                )
            out.add(by_id[id(item)])
        elif isinstance(item, nn.Module):
            if id(item) not in module_ids:
                raise InvalidArgumentError(
                    f"{what}= got a {type(item).__qualname__} that is not a submodule of the DDP model "
                    f"({type(module).__qualname__})."
                )
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
                    + (
                        f" Did you mean {', '.join(map(repr, close))}?"
                        if close
                        else " See model.named_modules() for the names."
                    )
                )
        else:
            raise InvalidArgumentError(
                f"{what}= items must be names, modules or parameters; got {type(item).__qualname__}."
            )
    return out


def _params_of(sub: nn.Module, by_id: dict[int, str], what: str, label: str) -> set[str]:
    names = {by_id[id(p)] for p in sub.parameters() if id(p) in by_id}
    if not names:
        raise InvalidArgumentError(f"{what}= names module {label!r}, which has no parameters.")
    return names
