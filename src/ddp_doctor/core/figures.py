"""The data behind the report's two figures: the usage map and the divergence curve.

Plain data, computed by `ddp_doctor.analyze.usage` from the records the report is built from, and carried in the
JSON report under the top-level keys `usage_map` and `divergence` (schema `ddp-doctor/report@1` onward; no
existing key changes). Bounded for big jobs: ranks that saw the same thing share one pattern, and parameters are
aggregated by module above `MAX_ROWS` rows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_PATTERNS",
    "MAX_ROWS",
    "NOTABLE",
    "STATES",
    "STATE_HELP",
    "Divergence",
    "RankPattern",
    "UsageMap",
    "UsageRow",
    "group_rows",
    "rank_grid",
    "rows_of",
]

STATES: dict[str, str] = {
    "U": "used",
    "N": "no gradient",
    "B": "blocked",
    "F": "frozen",
    "X": "flipped",
    "I": "ignored by DDP",
}
"""One character per cell of the usage map, and its name; `STATE_HELP` says what each means."""

STATE_HELP: dict[str, str] = {
    "U": "the parameter's gradient was accumulated in the step (it reached the loss)",
    "N": "trainable, but no gradient reached it and its module did not run in the step's forward",
    "B": "its module ran in the step's forward, yet no gradient reached it (torch.no_grad(), .detach(), a "
    "reentrant checkpoint without grad-requiring inputs)",
    "F": "requires_grad was False, as it was when DDP was built",
    "X": "requires_grad differs from what it was when DDP was built (frozen or unfrozen after wrapping)",
    "I": "listed in DDP's parameters to ignore: DDP never reduces it",
}

NOTABLE = "XBNUFI"
"""A module row (aggregated parameters) shows the first of these states that any of its parameters has."""

MAX_ROWS = 256
"""Above this many parameters, the usage map has one row per module instead of one per parameter."""

MAX_PATTERNS = 16
"""The most distinct rank patterns kept; the ranks of the rarer ones are listed in `ranks_omitted`."""


_KEYS = list(STATES)


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else "(top level)"


def group_rows(names: list[str]) -> tuple[list[str], list[str], list[int], bool]:
    """The usage map's rows for these parameter names: (row names, row modules, row index of each parameter,
    aggregated). One row per parameter up to `MAX_ROWS`; above, one per module at the deepest level that fits."""
    if len(names) <= MAX_ROWS:
        return names, [_module(n) for n in names], list(range(len(names))), False
    parts = [_module(n).split(".") for n in names]
    for depth in range(max(len(p) for p in parts), 0, -1):
        keys = [".".join(p[:depth]) for p in parts]
        distinct = list(dict.fromkeys(keys))
        if len(distinct) <= MAX_ROWS:
            index = {k: i for i, k in enumerate(distinct)}
            return distinct, [k.split(".")[0] for k in distinct], [index[k] for k in keys], True
    # Hundreds of top-level modules: consecutive runs of parameters, in model order.
    size = math.ceil(len(names) / MAX_ROWS)
    rows = [f"{names[i]} ... {names[min(i + size, len(names)) - 1]}" for i in range(0, len(names), size)]
    return rows, ["(parameters in model order)"] * len(rows), [i // size for i in range(len(names))], True


_rows_memo: list[Any] = [None, None]


def rows_of(param_names: list[str]) -> tuple[list[str], list[str], torch.Tensor, bool]:
    """`group_rows`, with the row of each parameter as a tensor: how the exchange builds each rank's grid and how
    the analysis names its rows. The in-process model hands one ModelInfo to every rank: the last list of names is
    remembered."""
    import torch  # here, not at the top: the report's renderers read this module without torch

    if _rows_memo[0] is not param_names:
        names, modules, row_of, aggregated = group_rows(param_names)
        _rows_memo[:] = [param_names, (names, modules, torch.tensor(row_of, dtype=torch.int64), aggregated)]
    return _rows_memo[1]


def rank_grid(
    *,
    used: torch.Tensor,
    ran: torch.Tensor,
    trainable: torch.Tensor,
    tracked: torch.Tensor,
    ignored: torch.Tensor,
    row_of: torch.Tensor,
    rows: int,
) -> torch.Tensor:
    """One rank's map: int64[rows, S] indices into `STATES`' keys, from its bool[S, P] `used`, `ran` and
    `trainable` and the group's bool[P] `tracked` (trainable at wrap time) and `ignored`. Later rules win: a
    flipped or ignored parameter is shown as such whatever else happened to it. Where a row stands for several
    parameters it shows the first state in `NOTABLE` that any of them has."""
    import torch

    state = torch.full(used.shape, _KEYS.index("N"), dtype=torch.int64)
    state[ran & ~used] = _KEYS.index("B")
    state[used] = _KEYS.index("U")
    state[~trainable] = _KEYS.index("F")
    state[trainable != tracked] = _KEYS.index("X")
    state[:, ignored] = _KEYS.index("I")
    if rows != used.shape[1] or not bool((row_of == torch.arange(rows)).all()):
        prio = torch.tensor([NOTABLE.index(k) for k in _KEYS])[state]
        init = torch.full((state.shape[0], rows), len(NOTABLE), dtype=torch.int64)
        best = init.scatter_reduce(-1, row_of.expand_as(prio), prio, reduce="amin", include_self=True)
        state = torch.tensor([_KEYS.index(k) for k in NOTABLE])[best]
    return state.T.contiguous()


@dataclass(kw_only=True, slots=True)
class UsageRow:
    """One row of the usage map: a parameter, or a module's parameters when aggregated."""

    name: str
    """The parameter's name, or the module path when aggregated."""
    module: str
    """The module the row belongs to (the group drawn around rows)."""
    params: int = 1
    """How many parameter tensors the row stands for."""
    numel: int = 0
    codes: list[str] = field(default_factory=list)
    """The finding codes that name this parameter (any of the module's parameters, when aggregated)."""


@dataclass(kw_only=True, slots=True)
class RankPattern:
    """What a set of ranks saw, identical on each of them: one string per row, one `STATES` character per step."""

    ranks: list[int]
    cells: list[str]


@dataclass(kw_only=True, slots=True)
class UsageMap:
    """Which parameter got a gradient on which rank at which step."""

    steps: int
    """Steps every rank completed (the columns)."""
    aggregated: bool
    """True when rows are modules, not parameters (more than `MAX_ROWS` parameters)."""
    rows: list[UsageRow]
    patterns: list[RankPattern]
    """Distinct per-rank patterns, the most common first (rank 0's always kept)."""
    ranks_omitted: list[int] = field(default_factory=list)
    """Ranks whose pattern was one of the rarest beyond `MAX_PATTERNS` distinct ones."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "states": dict(STATES)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageMap:
        return cls(
            steps=data["steps"],
            aggregated=data["aggregated"],
            rows=[UsageRow(**r) for r in data["rows"]],
            patterns=[RankPattern(**p) for p in data["patterns"]],
            ranks_omitted=list(data.get("ranks_omitted", [])),
        )


@dataclass(kw_only=True, slots=True)
class Divergence:
    """The largest cross-rank difference of weights and gradients, step by step, from the records' fingerprints.

    A fingerprint is two numbers per tensor (the sum, and a sum weighted by a fixed pattern); each value here is
    the max over parameters, over ranks r and over both numbers of |fingerprint(rank r) - fingerprint(rank 0)|.
    Zero means bit-identical on every rank (almost surely).
    """

    weights: list[float]
    """S + 1 values: index 0 when observing started, index k + 1 after step k's optimizer step."""
    grads: list[float]
    """S values: the gradients as the optimizer saw them in each step. Parameters without a gradient on every
    rank are left out of the max and counted in `grads_missing`."""
    grads_missing: list[int]
    """Per step, how many parameters had a gradient on some ranks but not on others."""
    weights_start: int | None
    """The first step after which the weights differed (-1: they differed when observing started)."""
    grads_start: int | None
    """The first step whose gradients differed (in value or in presence)."""

    @property
    def steps(self) -> int:
        return len(self.grads)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "measure": "max over parameters, ranks r and both fingerprint numbers of "
            "|fingerprint(rank r) - fingerprint(rank 0)|",
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Divergence:
        return cls(
            weights=[_number(w) for w in data["weights"]],
            grads=[_number(g) for g in data["grads"]],
            grads_missing=list(data["grads_missing"]),
            weights_start=data.get("weights_start"),
            grads_start=data.get("grads_start"),
        )


def _number(value: float | None) -> float:
    """JSON has no infinity: `finite()` wrote a difference against a NaN fingerprint as null."""
    return float("inf") if value is None else float(value)
