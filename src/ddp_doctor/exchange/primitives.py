"""Small fixed-shape collectives shared by the exchange, guard, refreeze and sync_gradients.

The rule that keeps them hang-free: a collective's shape and the decision to issue it never depend on local data.
The steady-state check is one all_reduce(MAX) of ``[x, -x]``, which gives every rank the same maximum and minimum
of every entry; only when those differ (every rank sees that identically) do more all_reduces follow to name the
ranks (`ddp_doctor.exchange.oddranks`: a few example ranks and a count, in a volume that does not grow with the world size).
`agree` is that sequence for a small header (a layout hash, counts, an error flag) that must be equal on every rank.
"""

from __future__ import annotations

import datetime
import logging
import zlib
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_doctor.core.compat import default_store
from ddp_doctor.core.errors import RankMismatchError, ReportTimeoutError
from ddp_doctor.core.ranks import named_ranks
from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.oddranks import CANDIDATES, EXAMPLES, name_flagged, odd_ranks, pick
from ddp_doctor.exchange.packing import Op, Reply

__all__ = ["Headers", "agree", "arrive", "comm_device", "global_ranks", "layout_hash", "minmax", "minmax_rounds"]

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


def minmax_rounds(values: torch.Tensor) -> Generator[Op, Reply, tuple[torch.Tensor, torch.Tensor]]:
    """Element-wise maximum and minimum of `values` over the ranks, in one MAX of ``[values, -values]``.

    `values` must have the same shape and dtype on every rank, and be finite (map NaN/inf first).

    Returns:
        ``(max, min)``, CPU tensors shaped like `values`, identical on every rank.
    """
    got = yield ("max", torch.cat([values.reshape(-1), -values.reshape(-1)]))
    n = values.numel()
    return got.tensor[:n].reshape(values.shape), (-got.tensor[n:]).reshape(values.shape)


def minmax(
    values: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`minmax_rounds` over `group`: one all_reduce. Collective."""
    return drive(minmax_rounds(values), group=group, device=device)


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
    """The headers `agree` returns, identical on every rank."""

    rows: list[list[float]]
    """The `match` values of each rank in `ranks`."""
    ranks: list[int]
    """Global ranks: the failed ranks named in `failed`."""
    failed: list[int]
    """Global ranks that passed a nonzero `failed` code to `agree` (the lowest `EXAMPLES`)."""
    codes: list[int]
    """The `failed` code of each rank in `ranks` (0: no local error)."""
    more_failed: int = 0
    """How many further ranks failed, beyond those in `failed`."""


def _listed(world: int, reference: int, odd: list[int]) -> list[int]:
    """The ranks whose header a mismatch message shows: every rank of a small group (at most ``EXAMPLES + 1``),
    otherwise the reference rank and the odd ranks named."""
    return list(range(world)) if world <= EXAMPLES + 1 else sorted({reference, *odd})


def _mismatch(
    what: str,
    cause: str,
    fix: str,
    describe: Callable[[list[float]], str],
    shown: dict[int, list[float]],
    odd: list[int],
    more: int,
    reference: int,
    proven: bool,
) -> str:
    """The `RankMismatchError` message: the headers `shown` (by global rank), and the odd ranks named."""
    listing = ", ".join(f"rank {r}: {describe(shown[r])}" for r in sorted(shown))
    unproven = "" if proven else f" (whose header is the most common of the first {CANDIDATES} compared, no more)"
    return f"{what} ({listing}; {named_ranks(odd, more)} differ from rank {reference}{unproven} in {cause}). {fix}"


def agree(
    match: Sequence[float],
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    what: str,
    cause: str,
    fix: str,
    describe: Callable[[list[float]], str],
    failed: int = 0,
) -> Headers | None:
    """Check that `match` is equal on every rank of `group`; raise `RankMismatchError` on every rank when not.

    Collective, with fixed shapes: `len(match)` must be equal on every rank (it depends on the call site, never on
    local data). Values must be exact in float64 (ints below 2**53, such as `layout_hash`).

    The check is one all_reduce(MAX) of ``2 * (len(match) + 1)`` numbers; only when the headers differ, which every
    rank sees identically, do a few more small all_reduces follow to name the failed or odd ranks
    (`ddp_doctor.exchange.oddranks`), in a volume that does not grow with the world size.

    Args:
        match: values that must be identical on every rank (a layout hash, a count).
        group: the process group (None: the default group).
        device: where the collective's tensors live (`comm_device`).
        what: what disagrees, for the message (``"guard() found different models on the ranks"``).
        cause: what `match` summarizes, for the message (``"names, shapes or dtypes"``).
        fix: what to do about it, for the message.
        describe: one rank's `match` values in words, for the message (``"8 tensors"``).
        failed: a nonzero code when this rank's local part failed. Any failure is shared with every rank before
            `match` is compared, and `agree` then returns the `Headers` instead of raising: the caller raises
            (every rank gets the same `Headers`, so every rank raises).

    Returns:
        None when every rank agrees and no rank failed; otherwise the `Headers` of the failed ranks (the lowest
        `EXAMPLES`, and a count of the others).

    Raises:
        RankMismatchError: `match` differs across ranks and no rank failed. The message names the ranks whose
            `match` differs from the most common one (the lowest `EXAMPLES`, and a count of the others) and shows
            their headers and the most common one (every rank's in a group of at most ``EXAMPLES + 1``).
    """
    header = torch.tensor([float(failed), *map(float, match)], dtype=torch.float64)
    hi, lo = minmax(header, group, device)
    if hi[0] != 0 or lo[0] != 0:  # some rank failed: name those ranks and return their codes
        [named] = name_flagged(header[:1] != 0, group=group, device=device)
        rows = pick(
            header.expand(len(named.examples), -1),
            torch.tensor(named.examples, dtype=torch.int64),
            group=group,
            device=device,
        ).tolist()
        ranks = global_ranks(group, named.examples)
        return Headers(
            rows=[row[1:] for row in rows],
            ranks=ranks,
            failed=ranks,
            codes=[int(row[0]) for row in rows],
            more_failed=named.more,
        )
    if not bool((hi != lo).any()):
        return None
    [odd] = odd_ranks(header[1:].unsqueeze(0), group=group, device=device)
    listed = _listed(dist.get_world_size(group), odd.reference, odd.odd.examples)
    rows = pick(
        header[1:].expand(len(listed), -1), torch.tensor(listed, dtype=torch.int64), group=group, device=device
    ).tolist()
    names = dict(zip(listed, global_ranks(group, listed)))
    raise RankMismatchError(
        _mismatch(
            what,
            cause,
            fix,
            describe,
            shown={names[r]: row for r, row in zip(listed, rows)},
            odd=[names[r] for r in odd.odd.examples],
            more=odd.odd.more,
            reference=names[odd.reference],
            proven=odd.proven,
        )
    )


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
            "or is elsewhere in its loop cannot answer."
        ) from exc
