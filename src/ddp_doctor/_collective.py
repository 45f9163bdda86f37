"""Small fixed-shape collectives shared by guard, refreeze and sync_gradients.

The rule that keeps them hang-free: a collective's shape and the decision to issue it never depend on local data.
The steady-state check is one all_reduce(MAX) of ``[x, -x]``, which gives every rank the same maximum and minimum
of every entry; only when those differ (every rank sees that identically) does a second, also fixed-shape,
all_gather follow to name the ranks.
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from ddp_doctor import _log
from ddp_doctor._compat import default_store
from ddp_doctor.errors import ReportTimeoutError

__all__ = ["arrive", "comm_device", "global_ranks", "layout_hash", "minmax", "rows_by_rank"]

logger = _log.get_logger(__name__)


def comm_device(group: dist.ProcessGroup | None, hint: torch.device | None = None) -> torch.device:
    """The device our small control tensors must live on for `group`'s backend.

    CPU when the backend can do CPU tensors (gloo, or a mixed ``cpu:gloo,cuda:nccl`` group); otherwise the CUDA
    device of `hint` (a parameter's device), or the current CUDA device.
    """
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if hint is not None and hint.type != "cpu":
        return hint
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def minmax(values: torch.Tensor, group: dist.ProcessGroup | None,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise maximum and minimum of `values` over the ranks of `group`, in one all_reduce. Collective.

    `values` must have the same shape and dtype on every rank, and be finite (map NaN/inf first).

    Returns:
        ``(max, min)``, CPU tensors shaped like `values`, identical on every rank.
    """
    both = torch.cat([values.reshape(-1), -values.reshape(-1)]).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    both = both.cpu()
    n = values.numel()
    return both[:n].reshape(values.shape), (-both[n:]).reshape(values.shape)


def rows_by_rank(values: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """Every rank's `values`, stacked in group-rank order (a CPU tensor ``[world, *values.shape]``). Collective."""
    local = values.contiguous().to(device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return torch.stack([o.cpu() for o in out])


def global_ranks(group: dist.ProcessGroup | None, group_ranks: Iterable[int]) -> list[int]:
    """Map ranks of `group` to global ranks (what users see in logs and torchrun)."""
    if group is None or group is dist.group.WORLD:
        return list(group_ranks)
    return [dist.get_global_rank(group, r) for r in group_ranks]


def layout_hash(items: Sequence[str]) -> int:
    """A 31-bit hash of a parameter list description (names, shapes, dtypes), equal on ranks that agree."""
    return zlib.crc32("\n".join(items).encode()) & 0x7FFFFFFF


def arrive(tag: str, *, group: dist.ProcessGroup | None, timeout: float, call: str, fix: str) -> None:
    """Wait until every rank of `group` reached `tag`, or raise `ReportTimeoutError` naming the ranks that did not.

    Goes through the default store, so a rank that never comes costs a timeout with names instead of a collective
    that waits forever. `call` names the collective call (``"refreeze()"``) and `fix` says how to call it.
    """
    store = default_store()
    if store is None:  # without it the process group's own timeout applies
        return
    members = global_ranks(group, range(dist.get_world_size(group)))
    keys = [f"ddp_doctor/{tag}/{r}" for r in members]
    store.set(keys[dist.get_rank(group)], "1")
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # the store raises its own timeout type, which differs by store kind
        missing = [r for r, k in zip(members, keys) if not store.check([k])]
        if not missing:
            raise
        raise ReportTimeoutError(
            f"rank {dist.get_rank()} waited {timeout:g} s in {call} for rank(s) {missing}. {call} is collective: "
            f"{fix} A rank that crashed, exited or is elsewhere in its loop cannot answer.") from exc
