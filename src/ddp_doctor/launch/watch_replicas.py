"""`ddp-doctor watch` past the first steps: do the replicas still hold the same parameters?

Every few optimizer steps, each rank fingerprints the parameters of every DDP model it trains (walked from the
module tree at that moment, so a parameter attached after the wrapper was built is in it) and writes them to
`replicas/rank{R}.{STEP}.json` in the run folder, keeping its last few. The parent (`WatchLoop`) reads the files of
its node's ranks, and at each step that every live rank has written compares the fingerprints, parameter by
parameter. The first step at which they differ is said while the job runs, and written to
`replicas.json`, which outlives the job.

Parameters the script told DDP to ignore (`compat.parameters_to_ignore`) are each rank's own and are left out. The
rank decides how often from what a point costs: at most `BUDGET` of the time between its steps (timed over the steps
between two points), and never more often than every `MIN_EVERY` steps. The interval is a power of two and a point
is taken at the steps it divides, so ranks that chose different intervals still meet at the multiples of the larger
one. Buffers are not compared (BatchNorm's running statistics differ between ranks after every forward, by design),
nor the shards of `fully_shard` on a 1-D mesh (each is held once). A model built with FSDP2's `replicate` is compared
as a DDP model is (each rank's local tensor is the whole parameter), and an HSDP model's shards among the ranks that
hold the same one (`ShardedModel.replica_row`: the ranks along the mesh's replicate dimension). Ranks on other nodes are compared by their own
node's `watch`.

The parent side imports no torch.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.core.rankfiles import read_json, write_json

__all__ = ["BUDGET", "MIN_EVERY", "ReplicaDivergence", "ReplicaPoints", "ReplicaWatch", "point_path"]

BUDGET = 0.005
"""The share of a rank's time between steps that fingerprinting may take."""
MIN_EVERY = 16
_KEPT = 8
"""Points a rank keeps: the parent, which looks every two seconds, finds a step every rank wrote even when the ranks
run apart by a few points or chose different intervals."""
SCHEMA = "ddp-doctor/replicas@1"
LOCAL_SGD = "local_sgd.json"
"""Written by a rank whose DDP model began post-local SGD: its points come after model averagings only."""


def point_path(folder: Path, rank: int, step: int) -> Path:
    return folder / "replicas" / f"rank{rank}.{step}.json"


def _steps(folder: Path, rank: int) -> set[int]:
    """The steps of the points `rank` wrote (and still keeps)."""
    out = set()
    for path in (folder / "replicas").glob(f"rank{rank}.*.json"):
        try:
            out.add(int(path.name.split(".")[1]))
        except (IndexError, ValueError):
            continue
    return out


class ReplicaPoints:
    """The rank side: called after each optimizer step past the first ones (`WatchPolicy`)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self._folder, self._rank = folder, rank
        self._written: list[Path] = []
        self._models: list[weakref.ref[Any]] = []
        self._every = MIN_EVERY
        self._group = ""
        self._spent = 0.0
        self._since: tuple[int, float] | None = None
        """(the step of the last point, when it was done): the steps between two points time the interval."""
        self._averaged_only = False
        """Post-local SGD began: points only after a model averaging over every rank."""

    def add_model(self, model: Any, group: str = "") -> None:
        """A DDP model, or the root of a model built with FSDP2 whose parameters have replicas (`ShardedModel.replica_row`):
        `group` names the ranks that must hold the same values (its replica row; "" for every rank)."""
        self._models.append(weakref.ref(model))
        self._group = group

    def stepped(self, step: int) -> None:
        """After optimizer step `step`: a point when `step` is a multiple of the rank's interval (every other step
        costs a modulo). Under post-local SGD, once it began, the replicas part between model averagings by design:
        points are then taken after each averaging instead (`averaged`)."""
        if step % self._every or not self._models or self._local_sgd():
            return
        start = time.perf_counter()
        self._write(step, {**self._point(step), "every": self._every, "spent_s": self._spent})
        done = time.perf_counter()
        cost = done - start
        self._spent += cost
        if self._since is not None and step > self._since[0]:
            between = (start - self._since[1]) / (step - self._since[0])  # a step's time, the points' left out
            self._every = max(MIN_EVERY, 1 << math.ceil(math.log2(max(1.0, cost / (BUDGET * between)))))
        self._since = (step, done)

    def averaged(self, step: int, group_size: int | None) -> None:
        """A model averager averaged the parameters over `group_size` ranks after optimizer step `step`: under
        post-local SGD the replicas are equal now, and a point is taken (after an averaging over the DDP model's whole
        process group only)."""
        group = getattr(self._models[0](), "process_group", None) if self._models else None
        if group is not None and group_size == group.size() and self._local_sgd():
            self._write(step, {**self._point(step), "every": 0, "spent_s": self._spent, "after": "averaging"})

    def _local_sgd(self) -> bool:
        """A DDP model's comm hook is torch's `post_localSGD_hook`, past its start and averaging over fewer ranks
        than all (`observation/model_averaging.py`); once true it stays true."""
        if not self._averaged_only:
            from ddp_doctor.observation.model_averaging import local_sgd_began

            self._averaged_only = any(local_sgd_began(ref()) for ref in self._models)
            if self._averaged_only:
                (self._folder / "replicas").mkdir(exist_ok=True)
                write_json(self._folder / "replicas" / LOCAL_SGD, {"schema": SCHEMA, "rank": self._rank})
        return self._averaged_only

    def _point(self, step: int) -> dict[str, Any]:
        from ddp_doctor.core.compat import is_dtensor, parameters_to_ignore
        from ddp_doctor.core.fingerprint import fingerprints_batched

        names: list[str] = []
        tensors = []
        for i, ref in enumerate(self._models):
            model = ref()
            if model is None:
                continue
            # A DDP model: its module's parameters, less those DDP leaves to each rank. A `replicate` model: its
            # own, each a DTensor whose local tensor is the whole parameter.
            ddp = hasattr(model, "module") and hasattr(model, "reducer")
            ignored = parameters_to_ignore(model) if ddp else set()
            for name, p in (model.module if ddp else model).named_parameters():
                if name in ignored:
                    continue
                names.append(f"{i}:{name}" if len(self._models) > 1 else name)
                tensors.append(p.to_local() if is_dtensor(p) else p)
        prints = fingerprints_batched(tensors).tolist()
        return {"step": step, "names": names, "fingerprints": prints, "group": self._group}

    def _write(self, step: int, point: dict[str, Any]) -> None:
        path = point_path(self._folder, self._rank, step)
        path.parent.mkdir(exist_ok=True)
        write_json(path, {"schema": SCHEMA, **point})
        self._written.append(path)
        for old in self._written[:-_KEPT]:
            old.unlink(missing_ok=True)
        del self._written[:-_KEPT]


@dataclass(kw_only=True)
class ReplicaDivergence:
    step: int
    """The first compared step at which the ranks' parameters differ."""
    agreed_step: int | None
    """The last compared step before it at which they agreed (None: none was compared)."""
    params: list[str]
    """The parameters that differ (the first 8)."""
    differing: int
    """How many differ."""
    groups: list[list[int]]
    """The ranks, grouped by the values they hold of the first differing parameter."""
    ranks: list[int]
    """The ranks compared (this node's live ranks)."""


@dataclass(kw_only=True)
class ReplicaWatch:
    """The parent side: compares the ranks' points as they appear."""

    folder: Path
    compared: list[int] = field(default_factory=list)
    """The steps compared, in order."""
    after_averaging: bool = False
    """The points compared were taken after a model averaging (post-local SGD)."""
    ranks: list[int] = field(default_factory=list)
    divergence: ReplicaDivergence | None = None

    def poll(self, live: set[int]) -> ReplicaDivergence | None:
        """Compare, in order, the steps every rank in `live` (at least two) has written since the last compared one;
        the divergence when it is the first one found."""
        if self.divergence is not None or len(live) < 2:
            return None
        common = set.intersection(*(_steps(self.folder, r) for r in live))
        for step in sorted(s for s in common if not self.compared or s > self.compared[-1]):
            at = {r: _read(point_path(self.folder, r, step)) for r in live}
            if any(p is None for p in at.values()):
                return None  # removed by its rank meanwhile: the next poll finds newer ones
            agreed = self.compared[-1] if self.compared else None
            self.compared.append(step)
            self.after_averaging = self.after_averaging or any(p.get("after") == "averaging" for p in at.values())
            self.ranks = sorted(live)
            differ, groups = _differ(at)
            if differ:
                self.divergence = ReplicaDivergence(
                    step=step,
                    agreed_step=agreed,
                    params=differ[:8],
                    differing=len(differ),
                    groups=groups,
                    ranks=sorted(live),
                )
                self.save()
                return self.divergence
        return None

    def save(self) -> None:
        write_json(self.folder / "replicas.json", self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The record `replicas.json` holds; `after_averaging` and `local_sgd` only under post-local SGD."""
        local_sgd = (self.folder / "replicas" / LOCAL_SGD).exists()
        return {
            "schema": SCHEMA,
            "compared_steps": self.compared,
            **({"after_averaging": self.after_averaging, "local_sgd": True} if local_sgd else {}),
            "ranks": self.ranks,
            "divergence": asdict(self.divergence) if self.divergence is not None else None,
        }


def _read(path: Path) -> dict[str, Any] | None:
    data = read_json(path)
    return data if data is not None and data.get("schema") == SCHEMA else None


def _same(a: list[float], b: list[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _differ(at: dict[int, dict[str, Any]]) -> tuple[list[str], list[list[int]]]:
    """The parameters whose fingerprints differ across ranks that must hold the same values (those of one `group`:
    every rank of a DDP or `replicate` model, the ranks holding the same shard of an HSDP model), and the ranks of
    the first such group, grouped by what they hold of the first one."""
    by_group: dict[str, dict[int, dict[str, Any]]] = {}
    for r, pt in sorted(at.items()):
        by_group.setdefault(pt.get("group", ""), {})[r] = pt
    for _, members in sorted(by_group.items()):
        if len(members) > 1 and (found := _differ_among(members))[0]:
            return found
    return [], []


def _differ_among(at: dict[int, dict[str, Any]]) -> tuple[list[str], list[list[int]]]:
    """The parameters whose fingerprints differ across the ranks' points (a parameter some ranks hold and others do
    not counts), and the ranks grouped by what they hold of the first one."""
    by_rank = {r: dict(zip(pt["names"], pt["fingerprints"])) for r, pt in at.items()}
    names: list[str] = []
    for table in by_rank.values():
        names += [n for n in table if n not in names]
    differ = []
    for name in names:
        values = [table.get(name) for table in by_rank.values()]
        first = values[0]
        if any(v is None for v in values) or not all(_same(first, v) for v in values[1:]):
            differ.append(name)
    groups: list[list[int]] = []
    if differ:
        kinds: list[tuple[Any, list[int]]] = []
        for r, table in sorted(by_rank.items()):
            value = table.get(differ[0])
            for kind, members in kinds:
                if (kind is None and value is None) or (kind is not None and value is not None and _same(kind, value)):
                    members.append(r)
                    break
            else:
                kinds.append((value, [r]))
        groups = [members for _, members in kinds]
    return differ, groups
