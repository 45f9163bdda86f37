"""Post-local SGD: DDP's gradient all-reduce turned off on purpose, and the model averaging that replaces it.

PyTorch's `post_localSGD_hook` (`torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook`) all-reduces the
gradients over every rank for the first `start_localSGD_iter` iterations, then over a subgroup only (of one rank
when `post_local_gradient_allreduce=False`): each rank, or each subgroup, steps on its own gradients and the
replicas part by design. A model averager (`PeriodicModelAverager`, `HierarchicalModelAverager`, or
`PostLocalSGDOptimizer` around the optimizer) then averages the parameters after the optimizer step every `period`
steps. `local_sgd_of` reads the hook's state; `Averagings` notes the averagers' all-reduces among the script's
collectives (they run inside torch's `model_averaging` package), after which step and over how many ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddp_doctor.core.frames import user_site_of
from ddp_doctor.observation import collectives
from ddp_doctor.observation.collectives import Call

__all__ = ["Averagings", "AveragingsDone", "from_averager", "local_sgd_began", "local_sgd_of"]

_HOOK_MODULE = "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook"
_AVERAGING = "model_averaging"
"""The folder of torch's averagers (`torch/distributed/algorithms/model_averaging/`): an all-reduce called from a
frame there averages parameters."""
MAX_STEPS = 64


def local_sgd_of(hook: Any, state: Any, group_size: int | None) -> dict[str, Any] | None:
    """The state of a registered `post_localSGD_hook` on a DDP model whose process group has `group_size` ranks:
    `from_iteration` (`start_localSGD_iter`), `iteration` (DDP iterations the hook has counted, which stops at
    `from_iteration`), `subgroup_size` (the ranks each gradient is still averaged over once local SGD began: 1
    without `post_local_gradient_allreduce`, None while the subgroup is not made yet) and `began` (it began, over
    fewer ranks than the group: the replicas now part between model averagings). None for any other hook."""
    func = getattr(hook, "func", hook)
    if getattr(func, "__module__", None) != _HOOK_MODULE or getattr(func, "__name__", "") != "post_localSGD_hook":
        return None
    subgroup = getattr(state, "subgroup", None)
    reduces = bool(getattr(state, "post_local_gradient_allreduce", True))
    found = {
        "from_iteration": int(getattr(state, "start_localSGD_iter", 0)),
        "iteration": int(getattr(state, "iter", 0)),
        "subgroup_size": (subgroup.size() if subgroup is not None else None) if reduces else 1,
    }
    found["began"] = found["iteration"] >= found["from_iteration"] and found["subgroup_size"] != group_size
    return found


def local_sgd_began(ddp: Any) -> bool:
    """`ddp` (a DDP model) runs post-local SGD and it began (`local_sgd_of`'s `began`)."""
    group = getattr(ddp, "process_group", None)
    size = group.size() if group is not None else None
    return any(
        (local_sgd_of(hook, state, size) or {}).get("began") for hook, state in getattr(ddp, "_comm_hooks", None) or []
    )


class Averagings:
    """The steps after which torch's model averagers all-reduced the parameters.

    Args:
        step: the observed step an averaging belongs to: the one in progress when it runs inside it
            (`PostLocalSGDOptimizer.step`), else the last closed one (an averager called after `optimizer.step()`).
    """

    def __init__(self, step: Callable[[], int]) -> None:
        self._step = step
        self._after: list[int] = []
        self._group_size: int | None = None
        self._site: str | None = None

    @property
    def found(self) -> dict[str, Any] | None:
        """`after_steps` (the observed steps after whose optimizer step the parameters were averaged, the first
        64), `group_size` (the ranks averaged over, the largest seen) and `site` (the script's line that called
        the averager); None when no averager ran."""
        if not self._after:
            return None
        return {"after_steps": list(self._after), "group_size": self._group_size, "site": self._site}

    def note(self, call: Call) -> None:
        """The script entered `call` (a listener of `observation/collectives.py` passes it on)."""
        if call.op != "all_reduce" or not from_averager(call.caller):
            return
        after = self._step()
        if after >= 0 and after not in self._after and len(self._after) < MAX_STEPS:
            self._after.append(after)
        self._group_size = max(self._group_size or 0, call.group_size or 0) or None
        self._site = self._site or user_site_of(call.caller, None)


class AveragingsDone:
    """Whether a model averager averaged the parameters since `take` was last called, for `watch` and `guard`, which
    compare the replicas right after an averaging under post-local SGD. The averager copies the averages into the
    parameters after its all-reduce returns: read them when the next optimizer step begins. Listens to the script's
    collectives from `start` to the stop function it returns."""

    def __init__(self) -> None:
        self._running: int | None = None
        self._done: int | None = None

    def start(self) -> Callable[[], None]:
        return collectives.listen(self._entered, self._returned)

    def take(self) -> int | None:
        """The number of ranks the latest averaging since the last call averaged over (None: there was none)."""
        done, self._done = self._done, None
        return done

    def _entered(self, call: Call) -> None:
        if call.op == "all_reduce" and from_averager(call.caller):
            self._running = call.group_size or 0

    def _returned(self) -> None:
        if self._running is not None:
            self._done, self._running = self._running, None


def from_averager(frame: Any, limit: int = 6) -> bool:
    """`frame`, or one of the few above it, runs in torch's `model_averaging` package."""
    while frame is not None and limit:
        if _AVERAGING in frame.f_code.co_filename:
            return True
        frame, limit = frame.f_back, limit - 1
    return False
