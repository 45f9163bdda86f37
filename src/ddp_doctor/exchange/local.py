"""What a rank reads from its own record for the exchange: step windows, its training loader, parameters named in
a DDP error, the entries of its per-step logs, parameters used outside DDP's view, the usage map's rows, and its
ModelInfo as JSON. No collectives here."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from ddp_doctor.core.figures import group_rows
from ddp_doctor.core.records import CRASH_KINDS, ModelInfo, RankRecord
from ddp_doctor.exchange.packing import text_digest, unkey
from ddp_doctor.exchange.summary import Curve

__all__ = [
    "curve_of",
    "first_set",
    "info_json",
    "leading_complete",
    "at_step",
    "hidden_params",
    "names_in_message",
    "rows_of",
    "training_loader",
    "windows",
]


def leading_complete(record: RankRecord) -> int:
    complete = record.counter("complete").bool().tolist()
    return next((i for i, c in enumerate(complete) if not c), len(complete))


def windows(record: RankRecord) -> list[tuple[int, list[int]]]:
    """Per optimizer step: (synced backward passes, the record's step indices in it). Steps are closed by
    optimizer.step() or, when a synced backward was not followed by one, by the next forward."""
    out, count, idx = [], 0, []
    synced, stepped = record.counter("synced_backwards").tolist(), record.counter("optimizer_step").tolist()
    for s, (n, opt) in enumerate(zip(synced, stepped)):
        count, idx = count + n, [*idx, s]
        if opt:
            out.append((count, idx))
            count, idx = 0, []
    return out


def training_loader(record: RankRecord) -> dict[str, Any] | None:
    """The first loader the rank iterated while observed that has a length (the training loop's, in practice)."""
    return next((d for d in record.loaders if d.get("batches") is not None), None)


def names_in_message(info: ModelInfo, text: str) -> list[int]:
    """Indices of parameters DDP named in an error message ("... with name head_b.bias has been marked ...")."""
    index = {n: i for i, n in enumerate(info.param_names)}
    return [index[m] for m in re.findall(r"with name (\S+)", text) if m in index]


def first_set(flags: list[bool]) -> int | None:
    return next((i for i, f in enumerate(flags) if f), None)


def at_step(log: list[str], step: int | None) -> list[str]:
    """The entries of a per-step log (`step N: text`) for `step`, without the prefix ([] for None)."""
    if step is None:
        return []
    prefix = f"step {step}: "
    return [entry.removeprefix(prefix) for entry in log if entry.startswith(prefix)]


def hidden_params(
    record: RankRecord, info: ModelInfo, tracked: torch.Tensor, pad_steps: int
) -> tuple[torch.Tensor, torch.Tensor, list[bool], list[int]]:
    """Parameters that got a gradient DDP's forward did not see coming (used but not reachable from its output),
    split by cause: [0] used outside DDP's forward, [1] inside reentrant activation checkpointing. Returns the
    parameters (bool[2, P]), the steps (bool[2, pad_steps]), whether this rank saw either, and whether its
    mark-ready-twice crash names them."""
    n_params = record.used.shape[1]
    hidden = torch.zeros(2, n_params, dtype=torch.bool)
    steps = torch.zeros(2, pad_steps, dtype=torch.bool)
    seen, crashed = [False, False], [0, 0]
    checkpoints, forwards = record.counter("reentrant_checkpoints"), record.counter("ddp_forwards")
    inner, split = record.counter("inner_passes"), record.counter("split_passes")
    mark_twice = CRASH_KINDS.index("mark-ready-twice")
    for step in range(record.steps):
        # Backward passes inside DDP's forward (Lightning's manual optimization) start from a loss, not from the
        # forward's outputs: Lightning prepares DDP's reduction from that loss, so nothing there is hidden from DDP.
        # A mark-ready-twice crash in a later backward pass through the step's forward is that pass's (a parameter
        # reached by two passes), not a parameter used outside forward.
        crashed_here = record.crash_kind == mark_twice and step == record.crash_step
        if not forwards[step] or inner[step] or (crashed_here and split[step]):
            continue
        target = 1 if checkpoints[step] else 0
        found = record.used[step] & ~record.reachable[step] & tracked
        named = False
        if crashed_here:
            idx = names_in_message(info, record.crash_message)
            found[idx] = True
            named = bool(idx)
            crashed[target] = 1
        if bool(found.any()) or named or checkpoints[step]:
            hidden[target] |= found
            steps[target, step] = True
            seen[target] = True
    return hidden, steps, seen, crashed


_rows_memo: list[Any] = [None, None]


def rows_of(info: ModelInfo) -> tuple[list[str], list[str], torch.Tensor, bool]:
    """The usage map's rows (`group_rows`), with the row of each parameter as a tensor. The in-process model hands
    one ModelInfo to every rank: the last one is remembered."""
    if _rows_memo[0] is not info.param_names:
        names, modules, row_of, aggregated = group_rows(info.param_names)
        _rows_memo[:] = [info.param_names, (names, modules, torch.tensor(row_of, dtype=torch.int64), aggregated)]
    return _rows_memo[1]


def curve_of(keys: torch.Tensor, s: int, w_missing: torch.Tensor, g_missing: torch.Tensor) -> Curve:
    gaps = [unkey(int(k)) for k in keys.tolist()]
    return Curve(
        weights=gaps[: s + 1], grads=gaps[s + 1 :], weights_missing=w_missing.tolist(), grads_missing=g_missing.tolist()
    )


_last_info: list[Any] = [None, b"", 0]


def info_json(info: ModelInfo) -> tuple[bytes, int]:
    """The ModelInfo as JSON and its digest. The in-process model hands one ModelInfo to every rank: the last one
    is remembered (the ranks of a real group each compute theirs once)."""
    if _last_info[0] is not info:
        data = json.dumps(info.to_dict(), sort_keys=True).encode()
        _last_info[:] = [info, data, text_digest(data)]
    return _last_info[1], _last_info[2]


# ------------------------------------------------------------------------------------------------ the protocol
