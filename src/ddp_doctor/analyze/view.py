"""The cross-rank view every detector reads: the exchange's `Summary`, with the derived masks named.

Nothing here is per rank: masks are over [S, P] (steps, parameters) or [P], and ranks are named only through the
summary's bounded examples (`Examples`: a count and up to `EXAMPLES` ranks). Time and memory do not grow with the
world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddp_doctor.core.codes import REPORT_ORDER, Code
from ddp_doctor.core.findings import Finding, ParamRef
from ddp_doctor.core.records import CRASH_KINDS
from ddp_doctor.core.summary import Examples, Summary

__all__ = ["ROADS", "Detector", "View", "detects", "detectors", "run_detectors"]

Detector = Callable[..., list[Finding]]
"""A function of the facts every rank agreed on that returns findings of one code: of a `View` (DDP's exchanged
`Summary`), of a `ShardedRun` (a model sharded with FSDP2's `fully_shard` or `replicate`), or of the `Agreed` facts
both give. One registered with ``reads_found=True`` also takes the codes the detectors before it found (a
`frozenset`)."""
ROADS = ("ddp", "sharded", "every")
"""What a detector reads: DDP's `View`, a sharded model's `ShardedRun`, or (``"every"``) the `Agreed` facts every
parallelism gives (`core/agreed.py`), on both roads."""
_DETECTORS: list[tuple[Code, Detector, str]] = []
_READS_FOUND: set[Detector] = set()
_EVERY: set[Detector] = set()


def detects(code: Code, *, reads_found: bool = False, road: str = "ddp") -> Callable[[Detector], Detector]:
    """Register a detector of `code`: a function of the agreed facts of its `road` (``"ddp"``: a `View` of the
    exchanged `Summary`; ``"sharded"``: a `ShardedRun`; ``"every"``: the `Agreed` facts both give) that returns
    findings of `code` only. The analysis of each road runs every detector registered for it and for every road
    (`analyze_summary`, `diagnose_sharded`); the report reads them in `REPORT_ORDER` (core/codes.py). A concept both
    roads check is decided once, on ``"every"``, where its facts have the shared shape; where they do not yet, a
    detector for each road sits side by side in the module its row in core/codes.py names, the parallelism an input
    to it.

    A finding whose fix depends on which other findings the report has (`replica-divergence`: fix the cause the
    other findings name, or say that none was seen) is decided by a detector with ``reads_found=True``: it runs
    after every other detector of its road, in `REPORT_ORDER`, and gets the codes found so far. No code edits a
    finding after it is made."""

    if code not in REPORT_ORDER:
        raise ValueError(f"{code}: add it to core/codes.py's REPORT_ORDER, where its findings read in the report")
    if road not in ROADS:
        raise ValueError(f"road={road!r}: a detector reads one of {', '.join(ROADS)}")

    def register(fn: Detector) -> Detector:
        _DETECTORS.append((code, fn, road))
        if reads_found:
            _READS_FOUND.add(fn)
        if road == "every":
            _EVERY.add(fn)
        return fn

    return register


def detectors(road: str = "ddp") -> list[tuple[Code, Detector]]:
    """The detectors `road` runs with their codes (its own and those registered for every road), in the report's
    reading order: by `REPORT_ORDER`, then in the order they were registered (several detectors of one code:
    `analyze/consistency.py`)."""
    mine = [(code, fn) for code, fn, r in _DETECTORS if r in (road, "every")]
    return sorted(mine, key=lambda d: REPORT_ORDER.index(d[0]))


def run_detectors(facts: Any, registered: tuple[Detector, ...], agreed: Any) -> list[Finding]:
    """Every detector's findings on `facts` (a `View`, or a `ShardedRun`), or on `agreed` (the `Agreed` facts they
    give) for a detector of every road, in the order of `registered`: those that read the other findings run last
    and get the codes of every finding made before them."""

    def read(d: Detector) -> Any:
        return agreed if d in _EVERY else facts

    found: list[list[Finding]] = [[] if d in _READS_FOUND else d(read(d)) for d in registered]
    for i, d in enumerate(registered):
        if d in _READS_FOUND:
            found[i] = d(read(d), frozenset(f.code for fs in found for f in fs))
    return [f for fs in found for f in fs]


class View:
    """The group's observations aligned on the steps every rank completed. W ranks, S common steps, P params."""

    def __init__(self, summary: Summary) -> None:
        self.summary = summary
        self.info = info = summary.info
        self.world = summary.world
        self.steps = s = summary.steps
        self.used_any = summary.used > 0  # [S, P]: some rank used it in the step
        self.used_all = summary.used == self.world  # [S, P]: every rank did
        self.train_any = summary.trainable > 0  # [S, P]
        self.train_all = summary.trainable == self.world  # [S, P]
        # Parameters a module replaced after DDP was built left behind in the reducer: nothing uses them any more
        # (`analyze/tree_state.py` says so). DDP still waits for their gradients, so the flags count them as unused;
        # but they say nothing about what the script trains: no finding of the used set names them, and they are
        # never advised to freeze.
        self.orphaned = torch.zeros_like(summary.tracked)
        self.orphaned[[i for i in summary.metas.get(0, {}).get("orphaned", []) if i < len(summary.tracked)]] = True
        self.tracked = summary.tracked
        # Parameters some ranks handed DDP as trainable and others as frozen (same names and shapes: DDP's
        # constructor accepted them): `param-shapes-differ`, not a freeze after the wrap.
        wrap = summary.wrap_trainable
        self.wrap_apart = (
            (wrap[:, 0] > 0) & (wrap[:, 0] < self.world) if wrap is not None else torch.zeros_like(self.tracked)
        )
        self.ignored = torch.tensor(info.ignored, dtype=torch.bool)
        # The step a crash interrupted: what got a gradient, or was reachable from DDP's outputs, before the crash
        # is evidence of use. What was not is unknown, not unused.
        self.partial_used = summary.partial
        cfg = info.ddp_config
        self.find_unused = bool(cfg.get("find_unused_parameters"))
        self.static_graph = bool(cfg.get("static_graph"))
        self.default_flags = not self.find_unused and not self.static_graph
        # Parameters DDP reduces and that stayed trainable throughout: the ones whose usage decides the flags.
        frozen_any = (~self.train_all).any(0) if s else torch.zeros_like(self.tracked)
        self.live = self.tracked & ~frozen_any
        self._usage: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def usage(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Over live params, [P] masks: (never used, used-set changes across steps, differs across ranks, always used).

        A crashed step's partial usage counts as evidence of use. Computed once: every detector asks.
        """
        if self._usage is not None:
            return self._usage
        never = self.live & ~self.used_any.any(0) & ~self.partial_used
        always = self.live & self.used_all.all(0) & (self.steps != 0)
        dynamic = self.live & (self.summary.varies | self.summary.after_crash)
        rank_dep = self.live & (self.used_any != self.used_all).any(0)
        self._usage = (never, dynamic, rank_dep, always)
        return self._usage

    def unused_by_cause(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Never-used live params split by cause, [P] masks: (dead: the module never ran in a training forward on
        any rank or step, so freezing it changes nothing the script does; blocked: the module ran, but no gradient
        reached the parameter: `no_grad`, `.detach()` or a reentrant checkpoint without grad-requiring inputs).
        Only the dead ones may ever be advised to freeze."""
        never = self.usage()[0]
        ran = self.summary.ran
        # A name re-pointed after the wrap (a module replaced, a weight re-tied) ran; the tensor DDP holds did not.
        return never & ~ran, never & ran & ~self.orphaned

    def _union(self, key: str) -> list[str]:
        return sorted({site for meta in self.summary.metas.values() for site in meta[key]})

    @property
    def blocked_checkpoints(self) -> list[str]:
        """Sites from group rank 0 and from the example ranks whose sites differ from its own."""
        return self._union("blocked_checkpoints")

    @property
    def bypass_sites(self) -> list[str]:
        return self._union("bypass_sites")

    @property
    def ever_used(self) -> torch.Tensor:
        return self.used_any.any(0) | self.partial_used

    def ranks(self, predicate: str) -> Examples:
        """The ranks (group ranks) for which `predicate` (one of `core.summary.PREDICATES`) held."""
        return self.summary.examples[predicate]

    def meta(self, rank: int) -> dict[str, Any]:
        return self.summary.metas[rank]

    # ------------------------------------------------------------------------------------------- helpers

    def params(self, mask: torch.Tensor | list[int]) -> list[ParamRef]:
        idx = mask.nonzero().flatten().tolist() if isinstance(mask, torch.Tensor) else mask
        names, shapes, numels = self.info.param_names, self.info.param_shapes, self.info.numels
        return [ParamRef(names[i], numels[i], tuple(shapes[i])) for i in idx]

    def buffers(self, mask: torch.Tensor) -> list[ParamRef]:
        names, shapes = self.info.buffer_names, self.info.buffer_shapes
        out = []
        for i in mask.nonzero().flatten().tolist():
            numel = 1
            for d in shapes[i]:
                numel *= d
            out.append(ParamRef(names[i], numel, tuple(shapes[i])))
        return out

    def crashed(self, kind: str) -> Examples:
        return self.summary.examples[f"crash:{kind}"]

    @property
    def crashed_before_first_step(self) -> bool:
        """DDP failed with 'Expected to have finished reduction' before any rank's optimizer stepped in an observed
        step: the steps seen are forwards of one optimizer step (closed when the next forward came), and a later
        forward of that step, which never ran, may have trained what the earlier ones did not (a GAN whose
        discriminator's pass comes first, each pass through its own forward)."""
        hi, _ = self.summary.steps_taken
        return bool(self.crashed(Code.REDUCTION_ERROR).count) and not any(hi[: self.steps])

    def crash_steps(self, kind: str) -> list[int]:
        row = self.summary.crash_steps[CRASH_KINDS.index(kind)]
        return [i - 1 for i in row.nonzero().flatten().tolist()]
