"""The check's control rounds: a flag every rank puts before the ranks go one way or the other, so that they all go
the same way. Each is one MAX of two numbers, whatever the world size.

| round | called from | collectives | puts | reads back |
|---|---|---|---|---|
| `following_agreed` | launch/following_run.py, at the end of the observed steps | MAX of 2 | this rank's steps trained on an open DataLoader pass | every rank's did: following starts on every rank, or on none |
| `epoch_repeated` | launch/plain_steps.py, at a sharded model's report | MAX of 2 | this rank saw its training sampler hand out an epoch again | some rank did (`sampler-epoch-not-set`) |
| `join_waits` | launch/joined.py, where the script's Join over a DDP model ends | MAX of 2 | this rank's observed steps ended inside the Join | some rank's did: every rank reports there |

`ROUNDS` lists them; `tests/exchange/test_control_rounds.py` runs each at 1,024 ranks in `simulate.lockstep`,
`tests/exchange/test_exchange_signature.py` holds their bytes, and `tests/design/test_one_road.py` that launch makes
no other collective of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from ddp_doctor.exchange.packing import Op, Reply
from ddp_doctor.exchange.primitives import minmax_rounds

__all__ = ["ROUNDS", "epoch_repeated", "following_agreed", "join_waits"]


def _flags(flag: bool) -> Generator[Op, Reply, tuple[bool, bool]]:
    """(some rank set its flag, every rank did), in one MAX of ``[flag, -flag]``."""
    high, low = yield from minmax_rounds(torch.tensor([float(flag)]))
    return bool(high[0]), bool(low[0])


def following_agreed(can_start: bool) -> Generator[Op, Reply, bool]:
    """True when every rank can start following the script to its epoch end (its observed steps trained on an open
    DataLoader pass): following then starts on every rank, and on none otherwise."""
    _, every = yield from _flags(can_start)
    return every


def epoch_repeated(seen: bool) -> Generator[Op, Reply, bool]:
    """True when some rank saw its training sampler hand out an epoch it had handed out before."""
    some, _ = yield from _flags(seen)
    return some


def join_waits(waiting: bool) -> Generator[Op, Reply, bool]:
    """True when some rank's observed steps ended inside the script's Join: every rank then reports where it ends."""
    some, _ = yield from _flags(waiting)
    return some


ROUNDS: dict[str, Callable[[bool], Generator[Op, Reply, bool]]] = {
    "following_agreed": following_agreed,
    "epoch_repeated": epoch_repeated,
    "join_waits": join_waits,
}
"""The control rounds by name, as the table above lists them."""
