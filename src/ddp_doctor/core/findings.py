"""The findings and the diagnosis: what the analysis decides, what every renderer and fix reads. Pure data."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ddp_doctor.core.codes import CODES, SEVERITIES
from ddp_doctor.core.figures import Divergence, UsageMap
from ddp_doctor.core.following import Following
from ddp_doctor.core.steptime import RankTiming
from ddp_doctor.core.whereabouts import Position

__all__ = [
    "Crash",
    "Diagnosis",
    "Finding",
    "Measure",
    "ParamRef",
    "Recommendation",
    "Timing",
    "Unchecked",
    "by_cause",
    "calls_of",
    "count",
    "finite",
    "lines_of",
]

_LINE = re.compile(r"([^\s(),;:'\"`]+\.py):(\d+)")
_CALL = re.compile(r"([\w.]+(?:\(\))?) at [^\s(),;:'\"`]+\.py:\d+")


def lines_of(*sites: str) -> list[str]:
    """The script lines (`file:line`) in recorded sites such as ``"no_sync() at train.py:12"`` or
    ``"train.py:40 (in step)"``, each once, in order: a finding's `sites`."""
    return list(dict.fromkeys(f"{m[1]}:{m[2]}" for site in sites for m in _LINE.finditer(site or "")))


def count(n: int, word: str) -> str:
    """``"1 parameter"``, ``"3 parameters"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def calls_of(*sites: str) -> list[str]:
    """The calls named in recorded sites such as ``"step 1: StepLR.step() at train.py:31"`` or
    ``"load_state_dict at resume.py:12"`` (the name before `at file:line`), each once, in order."""
    return list(dict.fromkeys(m[1] for site in sites for m in _CALL.finditer(site or "")))


@dataclass(frozen=True, slots=True)
class ParamRef:
    """A parameter (or buffer) by module path, with its size."""

    name: str
    numel: int
    shape: tuple[int, ...] = ()

    @property
    def size(self) -> str:
        """Its element count as the report writes it (a lazy module's parameter has none yet; a scalar has 1)."""
        return "size not known yet" if self.numel == 0 and not self.shape else f"{self.numel:,}"

    def __str__(self) -> str:
        return f"{self.name} ({self.size})"


@dataclass(frozen=True, slots=True)
class Measure:
    """A quantity a finding was decided on, with its unit (`"s"`, `"fraction"`, `"count"`, `"ratio"`, `"abs"` for a
    difference of values in the tensors' own unit, `"value"` for a setting read as it is)."""

    name: str
    value: float
    unit: str


@dataclass(kw_only=True, slots=True)
class Finding:
    """One diagnosed problem. `code` is a `ddp_doctor.core.codes.Code`, kept as its plain string (as `from_dict`
    reads it back)."""

    code: str
    severity: str
    title: str = ""
    """One line; empty where the report writes it from the evidence (`ddp_doctor.report.words`)."""
    detail: str = ""
    """What was seen and what it costs; empty where the report writes it, as the title."""
    params: list[ParamRef] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    fix: str = ""
    more_ranks: int = 0
    """Ranks that also showed it beyond those in `ranks`: at large world sizes the exchange names only examples
    (`ddp_doctor.exchange.EXAMPLES`) and counts the rest. In the JSON only when nonzero."""
    caused_by: list[str] = field(default_factory=list)
    """The codes of the findings of the same report that explain this one (`analyze/links.py`): it is their
    consequence, and the report shows it under them."""
    explains: list[str] = field(default_factory=list)
    """The codes of the findings of the same report that this one explains (the other end of `caused_by`)."""
    sites: list[str] = field(default_factory=list)
    """The script's lines (`file:line`) the finding is about, as the ranks recorded them (`lines_of`)."""
    measured: list[Measure] = field(default_factory=list)
    """The quantities the finding was decided on."""
    labels: dict[str, str] = field(default_factory=dict)
    """Evidence that is a name, not a number: which of a code's mechanisms this is (`kind`), the clock that timed
    the steps (`clock`), the call that wrote the weights (`call`), a DDP flag that explains it (`init_sync`), ...;
    docs/json-schema.md lists each code's keys."""
    ruled_out: list[str] = field(default_factory=list)
    """For a finding whose cause was not seen: the codes of the causes the check looked for and ruled out."""
    positions: list[Position] = field(default_factory=list)
    """For a run that failed: where the ranks the finding describes were when it ended (the first few of them,
    `core.whereabouts.SHOWN`). In the JSON only when there are some."""

    def __post_init__(self) -> None:
        assert self.code in CODES, f"unknown finding code {self.code!r}"
        self.code = str(self.code)  # a Code is its string; the plain one, so that a built and a read finding are alike
        assert self.severity in SEVERITIES, f"unknown severity {self.severity!r}"

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    def to_dict(self) -> dict[str, Any]:
        out = {
            "code": self.code,
            "severity": self.severity,
            "title": self.title,
            "detail": self.detail,
            "params": [{"name": p.name, "numel": p.numel, "shape": list(p.shape)} for p in self.params],
            "ranks": self.ranks,
            "steps": self.steps,
            "fix": self.fix,
        }
        if self.more_ranks:
            out["more_ranks"] = self.more_ranks
        out["caused_by"] = self.caused_by
        out["explains"] = self.explains
        out["sites"] = self.sites
        out["measured"] = [{"name": m.name, "value": finite(m.value), "unit": m.unit} for m in self.measured]
        out["labels"] = self.labels
        out["ruled_out"] = self.ruled_out
        if self.positions:
            out["positions"] = [p.to_dict() for p in self.positions]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        """The inverse of `to_dict`."""
        params = [ParamRef(p["name"], p["numel"], tuple(p.get("shape", ()))) for p in data["params"]]
        measured = [
            Measure(m["name"], math.nan if m["value"] is None else m["value"], m["unit"])
            for m in data.get("measured", [])
        ]
        positions = [Position.from_dict(p) for p in data.get("positions", [])]
        return cls(**{**data, "params": params, "measured": measured, "positions": positions})


@dataclass(kw_only=True, slots=True, frozen=True)
class Recommendation:
    """The cheapest DDP configuration that is correct for what was observed. Frozen: the analysis decides it once,
    its code included (`analyze/snippets.py`); a later fact (a verification run) makes a new one.

    The three flags are None together when nothing observed supports any flags (the ranks failed before they could
    compare, or the run was interrupted): the report then advises no flags, and `reason` says what is known. They
    are never filled with the script's own flags, which a reader of the JSON would take for advice.
    """

    find_unused_parameters: bool | None
    static_graph: bool | None
    gradient_as_bucket_view: bool | None
    freeze_before_wrap: list[str]
    reason: str
    verified: bool
    render: dict[str, str] = field(default_factory=dict)
    """Copy-pasteable code for `torch`, `transformers`, `accelerate` and `lightning` (empty when no flags are
    known)."""
    reshard: dict[str, Any] | None = None
    """For a model sharded with FSDP2: `reshard_after_forward=False` advised for one module (`module`, its
    `fully_shard` call's `site` and index `call`, the `all_gathers_per_step` it was counted at, and once a second run
    applied it, `verified_all_gathers_per_step`). In the JSON only when present."""
    verification: dict[str, Any] | None = None
    """What a second run with the recommended DDP flags showed (`analyze/recommend.py`, `verified_by_second_run`):
    `outcome` (`"verified"`, `"refuted"`, `"unconfirmed"` or `"not-run"`), the `ddp_kwargs` it applied (JSON),
    `steps_observed` and `steps_needed`, `errors` (the codes of its error findings), `crashed`, and `error` (why it
    made no report). The report words it after `reason`. In the JSON only when present."""

    @classmethod
    def unknown(cls, reason: str) -> Recommendation:
        """No flags to recommend: `reason` says why and what is known."""
        return cls(
            find_unused_parameters=None,
            static_graph=None,
            gradient_as_bucket_view=None,
            freeze_before_wrap=[],
            reason=reason,
            verified=False,
        )

    @property
    def flags_known(self) -> bool:
        """Whether the recommendation advises flags at all (see the class docstring)."""
        return None not in (self.find_unused_parameters, self.static_graph, self.gradient_as_bucket_view)

    @property
    def ddp_kwargs(self) -> dict[str, bool]:
        """The recommended flags as DDP keyword arguments; empty when no flags are known."""
        if not self.flags_known:
            return {}
        return {
            "find_unused_parameters": bool(self.find_unused_parameters),
            "static_graph": bool(self.static_graph),
            "gradient_as_bucket_view": bool(self.gradient_as_bucket_view),
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("reshard", "verification"):
            if out[key] is None:
                del out[key]
        if not self.flags_known:
            out["flags_known"] = False  # the flags are null; kept for readers of the older key
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recommendation:
        """Read `to_dict`'s output back (also a report written before the flags could be null: its
        `flags_known: false` flags were the script's own, placeholders, and read back as None)."""
        data = dict(data)
        if data.pop("flags_known", True) is False:
            data.update(find_unused_parameters=None, static_graph=None, gradient_as_bucket_view=None)
        return cls(**data)


@dataclass(kw_only=True, slots=True)
class Timing:
    """Per-step medians over every rank's complete observed steps, in seconds (observed, so hooks included), and
    each rank's step split into phases (`per_rank`)."""

    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    step_s: float | None = None
    per_rank: list[RankTiming] = field(default_factory=list)
    """The measured ranks among the lowest 8, the slowest and the fastest (what the exchange carries whole)."""
    ranks_measured: int = 0
    """Ranks that had steps to measure (more than `per_rank` lists beyond 8 ranks)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
            "step_s": self.step_s,
            "per_rank": [r.to_dict() for r in self.per_rank],
            "ranks_measured": self.ranks_measured,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Timing:
        return Timing(
            **{k: data.get(k) for k in ("forward_s", "backward_s", "optimizer_s", "step_s")},
            per_rank=[RankTiming.from_dict(r) for r in data.get("per_rank", [])],
            ranks_measured=data.get("ranks_measured", len(data.get("per_rank", []))),
        )


@dataclass(kw_only=True, slots=True)
class Crash:
    """A rank whose observed loop ended with an exception."""

    rank: int
    step: int
    kind: str
    message: str
    site: str = ""
    """`file:line  code` of the script's line that raised ("" when unknown)."""


@dataclass(frozen=True, slots=True)
class Unchecked:
    """Something the check did not compare or could not see: `what` names it (a stable key, docs/json-schema.md's
    `not_checked`), `facts` bound it (the steps observed, the loader, the parallelism whose gap it is, ...), `text`
    says it."""

    what: str
    text: str
    facts: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, **self.facts}


@dataclass(kw_only=True, frozen=True)
class Diagnosis:
    """What `analyze` returns: pure data, no torch.distributed involved. Frozen: nothing edits a diagnosis after the
    analysis returns it; a later input (the epoch ends followed, a failure after the steps) gives a new one through
    the analysis (`ddp_doctor.analyze`)."""

    findings: list[Finding]
    """Errors first."""
    recommendation: Recommendation
    """Its code (`render`) included."""
    timing: Timing
    steps_observed: int
    crashes: list[Crash] = field(default_factory=list)
    usage_map: UsageMap | None = None
    """The usage map's data (`analyze.usage`), from the exchange."""
    divergence: Divergence | None = None
    """The divergence curve's data."""
    following: Following | None = None
    """What `check` followed after the observed steps (the epoch ends, the loaders)."""
    unchecked: list[Unchecked] = field(default_factory=list)
    """What the check did not run or could not see."""
    files_written: list[dict[str, Any]] = field(default_factory=list)
    """Files the script wrote under the check, as following's exchange agreed on them (passed through)."""
    files_unlisted: int = 0
    """Ranks whose written files are not listed."""
    compared: dict[str, Any] | None = None
    """What the exchange compared across the ranks, with counts (`analyze/coverage.py`): the whole of what a
    report without findings may claim."""


def by_cause(findings: list[Finding]) -> list[tuple[Finding, list[Finding]]]:
    """The findings no other finding of the report explains (`Finding.caused_by`), each with the consequences shown
    under it (those whose chain of causes leads to it first); the causes most severe first, counting their
    consequences, in the report's order otherwise."""
    by_code = {f.code: f for f in findings}

    def root_of(f: Finding, seen: frozenset[str] = frozenset()) -> Finding:
        causes = [by_code[c] for c in f.caused_by if c in by_code and c not in seen]
        return root_of(causes[0], seen | {f.code}) if causes else f

    grouped: dict[int, list[Finding]] = {}
    order: list[Finding] = []
    for f in findings:
        root = root_of(f)
        if root is f:
            order.append(f)
        grouped.setdefault(id(root), [])
        if root is not f:
            grouped[id(root)].append(f)
    worst = {id(r): min(SEVERITIES.index(g.severity) for g in [r, *grouped[id(r)]]) for r in order}
    return [(r, grouped[id(r)]) for r in sorted(order, key=lambda r: worst[id(r)])]


def finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
