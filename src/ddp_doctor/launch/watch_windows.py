"""`ddp-doctor watch` past the first steps: where the step time goes, window by window.

Each rank times its optimizer steps past the first ones (one clock read per step) and the wait for data (from a
step's end to the first forward through its model after it: one clock read per forward, from a forward pre-hook),
and keeps the settings of the first DataLoader with a length it iterated (the rule holds only where one fed the
steps, as under `check`).
Every `WINDOW` steps it writes that window's figures to `windows/rank{R}.json` in the run folder, keeping its last
few: the steps, the median step and wait, the first quartile of the wait's share of the step, and the steps'
interquartile range. The parent (`WatchLoop`) reads its node's ranks' files, and for each window that every live
rank wrote applies the first steps' rule (`core/steptime.waits_for_data_at`, per rank; `input-bound` when more than
half of the ranks wait): a job that becomes input-bound past its first steps (a slower file system, a dataset whose
later items cost more) is said while it runs, and again when it stops being so (`CLEAR_AFTER` windows in a row); so is a median step that grew to
`SLOWER` times the first window's (and by at least `MIN_WAIT_S`), and a minority of ranks that wait for their data
where the others do not (`straggler-rank`: each of them waits at least `MIN_WAIT_S` longer than any other rank, a
wait the others spend in their next collective; a slow disk on one node). On a DDP model each rank also times its
lead, from the step's first forward to the first gradient of its output (one clock read in a forward hook, one in a
gradient hook on that output): ranks, half of them at most, whose work before the backward (the wait and the lead)
lags behind every other rank's by the first steps' straggler rule, while the others spend that time longer in the
rest of their step (DDP's all-reduce), are `straggler-rank` too (a slower device, other work on one rank's CPU).
Everything is written to `windows.json`, which outlives the job.

The parent side imports no torch.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.core.codes import Code
from ddp_doctor.core.rankfiles import read_json, write_json
from ddp_doctor.core.steptime import MIN_WAIT_S, straggles, waits_for_data_at

__all__ = ["CLEAR_AFTER", "SLOWER", "WINDOW", "StepWindows", "WindowEvent", "WindowWatch", "replay"]

WINDOW = 32
"""Optimizer steps per window."""
SLOWER = 1.5
"""A window's median step over the first window's, at least, to be said as a slowdown (and `MIN_WAIT_S` longer)."""
CLEAR_AFTER = 2
"""Windows in a row without a condition (input-bound, a straggler) before its end is said: one window a busy machine
scattered neither ends it nor, a window later, starts it again."""
_KEPT = 8
_LOADER_KEYS = ("dataset_type", "site", "num_workers", "pin_memory", "persistent_workers", "batch_size")


def _first_grad_tensor(output: Any) -> Any:
    """The first tensor of a forward's output that autograd will reach (a tensor, or one in a tuple, list or dict,
    one level down: a model's logits, a `ModelOutput`'s loss); None when there is none."""
    import torch  # the rank side only: the parent imports no torch

    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    return next((v for v in values if isinstance(v, torch.Tensor) and v.requires_grad), None)


def _path(folder: Path, rank: int) -> Path:
    return folder / "windows" / f"rank{rank}.json"


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


class StepWindows:
    """The rank side: `stepped` after each optimizer step past the first ones (`WatchPolicy`), `add_model` for each
    model whose forwards end the wait for data."""

    def __init__(self, folder: Path, rank: int) -> None:
        self._folder, self._rank = folder, rank
        self._last: float | None = None
        """When the last optimizer step ended (None until the first watched one)."""
        self._wait: float | None = None
        self._began: float | None = None
        """When the step's first forward began."""
        self._lead: float | None = None
        """From that forward to its output's first gradient (`add_model`'s `lead`)."""
        self._armed = False
        self._rows: list[tuple[float, float, float | None]] = []
        self._written: list[dict[str, Any]] = []
        self._hooks: list[Any] = []
        self.loader: dict[str, Any] | None = None
        """The first DataLoader with a length the script iterated (its settings): the rule holds only where one
        fed the steps, as the first steps' does."""

    def loader_started(self, info: dict[str, Any]) -> None:
        """A DataLoader pass began (a listener of `observation/dataloaders.py`)."""
        if self.loader is None and info.get("batches") is not None:
            self.loader = {k: info[k] for k in _LOADER_KEYS if info.get(k) is not None}

    def add_model(self, module: Any, *, lead: bool = False) -> None:
        """Time the wait for data to the first forward through `module` after each step; with `lead` (a DDP model,
        whose forward issues no collective a rank waits in for another's work) also the rank's lead: from that
        forward to the first gradient of its output in the backward (the forward, the loss and whatever the loop
        does before `backward()`), a rank's own work. The rest of the step (the backward with DDP's all-reduce, the
        optimizer step) is where the other ranks wait for a slow one."""
        import torch  # the rank side only: the parent imports no torch

        ref = weakref.ref(self)

        def on_backward(_grad: Any) -> None:
            windows = ref()
            if windows is not None and windows._began is not None and windows._lead is None:
                windows._lead = time.perf_counter() - windows._began

        def on_forward(*_: Any) -> None:
            windows = ref()
            if windows is not None and windows._last is not None and windows._wait is None:
                windows._began = time.perf_counter()
                windows._wait = windows._began - windows._last

        def after_forward(_module: Any, _args: Any, output: Any) -> None:
            windows = ref()
            if windows is None or windows._began is None or windows._armed or not torch.is_grad_enabled():
                return
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                windows._armed = True
                tensor.register_hook(on_backward)

        self._hooks.append(module.register_forward_pre_hook(on_forward, prepend=True))
        if lead:
            self._hooks.append(module.register_forward_hook(after_forward))

    def stepped(self, step: int) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._rows.append((now - self._last, self._wait or 0.0, self._lead))
        self._last, self._wait, self._began, self._lead, self._armed = now, None, None, None, False
        if len(self._rows) >= WINDOW:
            self._write(step)

    def _write(self, step: int) -> None:
        rows, self._rows = self._rows, []
        steps = [s for s, _, _ in rows]
        waits = [w for _, w, _ in rows]
        shares = [w / s if s > 0 else 0.0 for s, w, _ in rows]
        q1, median, q3 = _quartiles(steps)
        # The rank's own work before the backward (its wait between steps and its lead) and the rest of the step,
        # over the steps whose lead was timed (most of them, or none said).
        led = [(w + lead, s - w - lead) for s, w, lead in rows if lead is not None]
        own = {}
        if 2 * len(led) > len(rows):
            own_q1, own_s, own_q3 = _quartiles([o for o, _ in led])
            own = {
                "own_s": own_s,
                "own_q1_s": own_q1,
                "own_q3_s": own_q3,
                "rest_s": statistics.median(r for _, r in led),
            }
        self._written.append(
            {
                **own,
                "first": step - len(rows) + 1,
                "last": step,
                "steps": len(rows),
                "step_s": median,
                "wait_s": statistics.median(waits),
                "share_q1": _quartiles(shares)[0],
                "step_iqr_s": q3 - q1,
                "loader": self.loader,
            }
        )
        self._written = self._written[-_KEPT:]
        path = _path(self._folder, self._rank)
        path.parent.mkdir(exist_ok=True)
        write_json(path, {"windows": self._written})


def _ahead_of_backward(rows: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The ranks, half of them at most, whose own work before the backward (their wait between steps and their lead:
    `StepWindows.add_model`) lagged behind every other rank's in the window, by the first steps' straggler rule
    (`core/steptime.straggles`) on the window's figures: the slow ranks' least own work against the others' most,
    and the others' shortest rest of the step (their wait in DDP's all-reduce) against the slow ranks' longest.
    Empty when no such ranks, or when some rank's lead was not timed."""
    if len(rows) < 2 or not all("own_s" in w for w in rows.values()):
        return {}
    order = sorted(rows, key=lambda r: rows[r]["own_s"], reverse=True)
    for k in range(1, len(order) // 2 + 1):
        slow, others = order[:k], order[k:]
        own, others_own = min(rows[r]["own_s"] for r in slow), max(rows[r]["own_s"] for r in others)
        waited = min(rows[r]["rest_s"] for r in others) - max(rows[r]["rest_s"] for r in slow)
        if straggles(
            own=own,
            others_own=others_own,
            own_quartiles=(min(rows[r]["own_q1_s"] for r in slow), max(rows[r]["own_q3_s"] for r in slow)),
            others_q3=max(rows[r]["own_q3_s"] for r in others),
            others_comm=waited,
            own_comm=0.0,
        ):
            return {
                "lagging": sorted(slow),
                "lagging_in": "work",
                "own_s": [own, max(rows[r]["own_s"] for r in slow)],
                "others_own_s": others_own,
                "others_waited_s": waited,
            }
    return {}


@dataclass(frozen=True, slots=True)
class WindowEvent:
    """A change the parent saw in one window: `kind` is `input-bound` (most ranks wait for data), `input-ok` (they
    no longer do), `slower` (the median step grew to `SLOWER` times the first window's), `straggler-rank` (some
    ranks, fewer than half, wait for their data and the others for them) or `straggler-ok` (no longer)."""

    kind: str
    first: int
    last: int
    ranks: list[int]
    """The ranks compared; for `input-bound` and `straggler-rank`, those that waited for their data."""
    step_s: tuple[float, float]
    """The ranks' median steps in the window, lowest and highest."""
    wait_s: tuple[float, float]
    """The ranks' median waits for data in the window, lowest and highest (of the waiting ranks for `input-bound`
    and `straggler-rank`)."""
    others_wait_s: float | None = None
    """For `straggler-rank` in their data: the longest median wait for data among the other ranks."""
    lag: str | None = None
    """For `straggler-rank`: `data` (these ranks waited for their data where the others did not) or `work` (their
    own work before the backward took longer: `own_s`, `others_own_s`, `others_waited_s`)."""
    own_s: tuple[float, float] | None = None
    """For a `work` lag: the lagging ranks' median own work before the backward, lowest and highest."""
    others_own_s: float | None = None
    """For a `work` lag: the longest median own work before the backward among the other ranks."""
    others_waited_s: float | None = None
    """For a `work` lag: how much longer, at least, every other rank's rest of the step took (its wait in DDP's
    all-reduce for them)."""
    baseline_step_s: float | None = None
    """For `slower`: the first window's highest median step."""
    loader: dict[str, Any] | None = None
    """For `input-bound`: the training DataLoader's settings, as the lowest waiting rank described it."""


def _event(kind: str, entry: dict[str, Any], *, ranks: list[int], wait_s: list[float], **fields: Any) -> WindowEvent:
    """A `WindowEvent` of `kind` over the judged window `entry`: its steps and step times, `ranks` and their waits
    for data, and the kind's own `fields`."""
    return WindowEvent(
        kind=kind,
        first=entry["first"],
        last=entry["last"],
        ranks=ranks,
        step_s=tuple(entry["step_s"]),
        wait_s=tuple(wait_s),
        **fields,
    )


@dataclass
class WindowWatch:
    """The parent side: `poll` every few seconds with the live ranks."""

    folder: Path
    judged: list[dict[str, Any]] = field(default_factory=list)
    _input_bound: bool = False
    _slower: bool = False
    _lagging: tuple[int, ...] = ()
    _input_quiet: int = 0
    """Windows in a row judged not input-bound."""
    _lagging_quiet: int = 0
    """Windows in a row where no rank lagged."""

    def poll(self, live: set[int], remote: dict[int, list[dict[str, Any]]] | None = None) -> list[WindowEvent]:
        """Judge each window every live rank of this node wrote, and, on several nodes (`remote`: the other nodes'
        ranks' windows, `NodeShare.windows`), every rank of the job: a window waits until another node's rows for it
        have come."""
        if not live:
            return []
        by_rank: dict[int, dict[tuple[int, int], dict[str, Any]]] = {}
        for r in live:
            data = read_json(_path(self.folder, r)) or {}
            by_rank[r] = {(w["first"], w["last"]): w for w in data.get("windows", [])}
        if remote is not None:
            if not remote:
                return []
            for r, rows in remote.items():
                by_rank.setdefault(r, {(w["first"], w["last"]): w for w in rows})
        done = {(w["first"], w["last"]) for w in self.judged}
        common = sorted(set.intersection(*(set(k) for k in by_rank.values())) - done)
        events = []
        for key in common:
            events += self._judge(key, {r: by_rank[r][key] for r in sorted(by_rank)})
        if common:
            self.save()
        return events

    def _judge(self, key: tuple[int, int], rows: dict[int, dict[str, Any]]) -> list[WindowEvent]:
        waiting = [
            r
            for r, w in rows.items()
            if w.get("loader") is not None
            and waits_for_data_at(
                steps=w["steps"],
                wait_s=w["wait_s"],
                step_s=w["step_s"],
                share_q1=w["share_q1"],
                step_iqr_s=w["step_iqr_s"],
            )
        ]
        steps = [w["step_s"] for w in rows.values()]
        waits = [rows[r]["wait_s"] for r in waiting]
        entry = {
            "first": key[0],
            "last": key[1],
            "ranks": sorted(rows),
            "step_s": [min(steps), max(steps)],
            "wait_s": [min(w["wait_s"] for w in rows.values()), max(w["wait_s"] for w in rows.values())],
            "waiting": waiting,
            "waiting_wait_s": [min(waits), max(waits)] if waits else None,
            "loader": rows[waiting[0]].get("loader") if waiting else None,
            "input_bound": 2 * len(waiting) > len(rows),
        }
        others = [w["wait_s"] for r, w in rows.items() if r not in waiting]
        entry["others_wait_s"] = max(others) if others else None
        # A minority waits for its data, each at least `MIN_WAIT_S` longer than any other rank: the others wait
        # for them in their next collective (DDP's all-reduce), whatever their own reads cost.
        apart = bool(waits and others) and min(waits) >= max(others) + MIN_WAIT_S
        entry["lagging"] = waiting if apart and not entry["input_bound"] else []
        entry["lagging_in"] = "data" if entry["lagging"] else None
        if not entry["lagging"] and not entry["input_bound"]:
            entry.update(_ahead_of_backward(rows))
        return self._events(entry)

    def _events(self, entry: dict[str, Any]) -> list[WindowEvent]:
        """The changes `entry` (a judged window) shows after the windows judged before it; judged from here on."""
        baseline = self.judged[0]["step_s"][1] if self.judged else None
        self.judged.append(entry)
        bound, steps = entry["input_bound"], tuple(entry["step_s"])
        events = []
        self._input_quiet = 0 if bound else self._input_quiet + 1
        if bound != self._input_bound and (bound or self._input_quiet >= CLEAR_AFTER):
            self._input_bound = bound
            events.append(
                _event(
                    Code.INPUT_BOUND.value if bound else "input-ok",
                    entry,
                    ranks=entry["waiting"] if bound else entry["ranks"],
                    wait_s=entry["waiting_wait_s"] if bound else entry["wait_s"],
                    loader=entry.get("loader") if bound else None,
                )
            )
        # A step grown by a few milliseconds on a tiny model is the machine's noise, not the job's: at least
        # `MIN_WAIT_S` more per step as well.
        slower = baseline is not None and steps[0] >= max(SLOWER * baseline, baseline + MIN_WAIT_S)
        if slower and not self._slower:
            events.append(
                _event("slower", entry, ranks=entry["ranks"], wait_s=entry["wait_s"], baseline_step_s=baseline)
            )
        self._slower = slower
        lagging = tuple(entry.get("lagging") or ())
        work = bool(lagging) and entry.get("lagging_in") == "work"
        data = bool(lagging) and not work
        self._lagging_quiet = 0 if lagging else self._lagging_quiet + 1
        if lagging != self._lagging and (lagging or self._lagging_quiet >= CLEAR_AFTER):
            self._lagging = lagging
            events.append(
                _event(
                    Code.STRAGGLER_RANK.value if lagging else "straggler-ok",
                    entry,
                    ranks=list(lagging) if lagging else entry["ranks"],
                    wait_s=entry["waiting_wait_s"] if data else entry["wait_s"],
                    others_wait_s=entry.get("others_wait_s") if data else None,
                    loader=entry.get("loader") if data else None,
                    lag=entry.get("lagging_in", "data") if lagging else None,
                    own_s=tuple(entry["own_s"]) if work else None,
                    others_own_s=entry.get("others_own_s") if work else None,
                    others_waited_s=entry.get("others_waited_s") if work else None,
                )
            )
        return events

    def save(self) -> None:
        write_json(self.folder / "windows.json", self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "ddp-doctor/windows@1", "window": WINDOW, "windows": self.judged}


def replay(windows: dict[str, Any]) -> list[WindowEvent]:
    """The changes a run's `windows.json` shows, in order, as `watch` said them while the job ran (`explain`)."""
    again = WindowWatch(folder=Path("."))
    return [event for entry in windows.get("windows", []) for event in again._events(dict(entry))]
