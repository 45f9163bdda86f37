"""Small fixed-shape collectives shared by gather, guard, refreeze and sync_gradients.

The rule that keeps them hang-free: a collective's shape and the decision to issue it never depend on local data.
The steady-state check is one all_reduce(MAX) of ``[x, -x]``, which gives every rank the same maximum and minimum
of every entry; only when those differ (every rank sees that identically) does a second, also fixed-shape,
all_gather follow to name the ranks. `agree` is that sequence for a small header (a layout hash, counts, an error
flag) that must be equal on every rank.
"""

from __future__ import annotations

import datetime
import logging
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_doctor._compat import default_store
from ddp_doctor.errors import RankMismatchError, ReportTimeoutError

__all__ = ["Headers", "agree", "arrive", "comm_device", "global_ranks", "layout_hash", "minmax", "rows_by_rank"]

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True, slots=True)
class Headers:
    """Every rank's header after `agree`, identical on every rank."""

    rows: list[list[float]]
    """Each member's header (``match`` then ``carry`` values), in group-rank order."""
    ranks: list[int]
    """The members' global ranks, in group-rank order."""
    failed: list[int]
    """Global ranks that passed a nonzero `failed` code to `agree`."""
    codes: list[int]
    """Each member's `failed` code, in group-rank order (0: no local error)."""

    def per_rank(self, describe: Callable[[list[float]], str]) -> str:
        """``"rank 0: <describe(row)>, rank 1: ..."`` for every member."""
        return ", ".join(f"rank {r}: {describe(row)}" for r, row in zip(self.ranks, self.rows))


def _odd_ranks(keys: list[tuple[float, ...]], ranks: list[int]) -> tuple[list[int], int]:
    """(global ranks whose key differs from the most common one, the rank holding that one; lowest on a tie)."""
    counts = Counter(keys)
    top = max(counts.values())
    reference = next(i for i, k in enumerate(keys) if counts[k] == top)
    return [r for r, k in zip(ranks, keys) if k != keys[reference]], ranks[reference]


def agree(match: Sequence[float], *, group: dist.ProcessGroup | None, device: torch.device, what: str, cause: str,
          fix: str, describe: Callable[[list[float]], str], carry: Sequence[float] = (),
          failed: int = 0) -> Headers | None:
    """Check that `match` is equal on every rank of `group`; raise `RankMismatchError` on every rank when not.

    Collective, with fixed shapes: `len(match)` and `len(carry)` must be equal on every rank (they depend on the
    call site, never on local data). Values must be exact in float64 (ints below 2**53, such as `layout_hash`).

    Without `carry`, the check is one all_reduce(MAX) of ``2 * (len(match) + 1)`` numbers; a second collective (an
    all_gather of the headers) runs only when they differ, which every rank sees identically. With `carry` (values
    allowed to differ, that every rank needs from every other, such as record lengths) it is one all_gather.

    Args:
        match: values that must be identical on every rank (a layout hash, a count).
        group: the process group (None: the default group).
        device: where the collective's tensors live (`comm_device`).
        what: what disagrees, for the message (``"guard() found different models on the ranks"``).
        cause: what `match` summarizes, for the message (``"names, shapes or dtypes"``).
        fix: what to do about it, for the message.
        describe: one rank's header row (``match`` then ``carry``) in words, for the message (``"8 tensors"``).
        carry: values that may differ across ranks and are returned in `Headers.rows`.
        failed: a nonzero code when this rank's local part failed. Any failure is shared with every rank before
            `match` is compared, and `agree` then returns the `Headers` instead of raising: the caller raises
            (every rank gets the same `Headers`, so every rank raises).

    Returns:
        None when every rank agrees and no rank failed (without `carry`); otherwise every rank's `Headers`.

    Raises:
        RankMismatchError: `match` differs across ranks and no rank failed. The message lists every rank's header
            and names the ranks whose `match` differs from the most common one.
    """
    n = len(match)
    header = torch.tensor([float(failed), *map(float, match), *map(float, carry)], dtype=torch.float64)
    if not carry:
        hi, lo = minmax(header, group, device)
        if not bool((hi != lo).any()) and hi[0] == 0:
            return None
    everyone = rows_by_rank(header, group, device).tolist()
    ranks = global_ranks(group, range(len(everyone)))
    codes = [int(row[0]) for row in everyone]
    headers = Headers(rows=[row[1:] for row in everyone], ranks=ranks,
                      failed=[r for r, c in zip(ranks, codes) if c], codes=codes)
    if headers.failed:
        return headers
    keys = [tuple(row[1:1 + n]) for row in everyone]
    if len(set(keys)) > 1:
        odd, reference = _odd_ranks(keys, ranks)
        raise RankMismatchError(
            f"{what} ({headers.per_rank(describe)}; rank(s) {odd} differ from rank {reference} in {cause}). {fix}")
    return headers


def arrive(tag: str, *, group: dist.ProcessGroup | None, timeout: float, call: str, fix: str) -> None:
    """Wait until every rank of `group` reached `tag`, or raise `ReportTimeoutError` naming the ranks that did not.

    Goes through the default store, so a rank that never comes costs a timeout with names instead of a collective
    that waits forever. `call` names the collective call (``"refreeze()"``) and `fix` says how to call it.
    """
    store = default_store()
    if store is None:  # without it the process group's own timeout applies
        return
    size = dist.get_world_size(group)
    members = global_ranks(group, range(size))
    keys = [f"ddp_doctor/{tag}/{r}" for r in members]
    store.set(keys[dist.get_rank(group)], "1")
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # the store raises its own timeout type, which differs by store kind
        missing = [r for r, k in zip(members, keys) if not store.check([k])]
        if not missing:
            raise
        whole = group is None or group is dist.group.WORLD
        raise ReportTimeoutError(
            f"rank {dist.get_rank()} waited {timeout:g} s in {call} for rank(s) {missing} of "
            f"{'world' if whole else 'group'} size {size}. {call} is collective: {fix} A rank that crashed, exited "
            "or is elsewhere in its loop cannot answer.") from exc
