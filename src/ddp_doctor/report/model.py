"""The result objects: what the doctor knows. Renderers (text, JSON) read them; nothing here prints."""

from __future__ import annotations

import json
import math
from collections.abc import Sized
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ddp_doctor.codes import CODES, SEVERITIES
from ddp_doctor.report.figures import Divergence, UsageMap
from ddp_doctor.report.ranks import rank_list

__all__ = ["SCHEMA", "Crash", "Diagnosis", "Finding", "ParamRef", "Recommendation", "Report", "Timing", "finite"]

SCHEMA = "ddp-doctor/report@1"



@dataclass(frozen=True, slots=True)
class ParamRef:
    """A parameter (or buffer) by module path, with its size."""

    name: str
    numel: int
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.name} ({self.numel:,})"


@dataclass(kw_only=True, slots=True)
class Finding:
    """One diagnosed problem. `code` is one of `ddp_doctor.codes.CODES`."""

    code: str
    severity: str
    title: str
    detail: str
    params: list[ParamRef] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    fix: str = ""
    more_ranks: int = 0
    """Ranks that also showed it beyond those in `ranks`: at large world sizes the exchange names only examples
    (`ddp_doctor.exchange.EXAMPLES`) and counts the rest. In the JSON only when nonzero."""

    def __post_init__(self) -> None:
        assert self.code in CODES, f"unknown finding code {self.code!r}"
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
        return out


@dataclass(kw_only=True, slots=True)
class Recommendation:
    """The cheapest DDP configuration that is correct for what was observed."""

    find_unused_parameters: bool
    static_graph: bool
    gradient_as_bucket_view: bool
    freeze_before_wrap: list[str]
    reason: str
    verified: bool
    render: dict[str, str] = field(default_factory=dict)
    """Copy-pasteable code for `torch`, `transformers`, `accelerate` and `lightning`."""

    @property
    def ddp_kwargs(self) -> dict[str, bool]:
        return {
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True, slots=True)
class Timing:
    """Per-step medians over every rank's complete observed steps, in seconds (observed, so hooks included)."""

    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    step_s: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)


@dataclass(kw_only=True, slots=True)
class Crash:
    """A rank whose observed loop ended with an exception."""

    rank: int
    step: int
    kind: str
    message: str


@dataclass(kw_only=True)
class Diagnosis:
    """What `analyze` returns: pure data, no torch.distributed involved."""

    findings: list[Finding]
    recommendation: Recommendation
    timing: Timing
    steps_observed: int
    crashes: list[Crash] = field(default_factory=list)
    usage_map: UsageMap | None = None
    """The usage map's data (`analyze.usage`), from the exchange."""
    divergence: Divergence | None = None
    """The divergence curve's data."""


@dataclass(kw_only=True)
class Report:
    """The doctor's report, identical on every rank. `print(report)` renders it; `to_dict()` is the JSON schema."""

    tool_version: str
    torch_version: str
    backend: str
    world_size: int
    steps_observed: int
    ddp_config: dict[str, Any]
    findings: list[Finding]
    recommendation: Recommendation
    timing: Timing
    crashes: list[Crash] = field(default_factory=list)
    framework: str = "torch"
    ddp_site: str | None = None
    interrupted: bool = False
    """`ddp-doctor` was stopped by SIGINT / SIGTERM / SIGHUP before the observed steps ended: a partial report."""
    usage_map: UsageMap | None = None
    """Which parameter got a gradient on which rank at which step (JSON key `usage_map`, absent when None)."""
    divergence: Divergence | None = None
    """The largest cross-rank difference of weights and gradients per step (JSON key `divergence`)."""
    schema: str = SCHEMA

    @classmethod
    def build(cls, info: Any, records: Sized, diagnosis: Diagnosis, *, backend: str) -> Report:
        """The report of one DDP model: `records` counts the ranks (any sized collection: a range at scale)."""
        from ddp_doctor import __version__
        from ddp_doctor.report.snippets import render_snippets  # imports this module: imported here, not at the top

        # The code for the recommendation is rendered here, from the records alone: the flavour (which Lightning
        # package, which TrainingArguments fields) was recorded where the model was built.
        diagnosis.recommendation.render = render_snippets(diagnosis.recommendation, info.ddp_config, info.flavor)
        return cls(
            tool_version=__version__,
            torch_version=torch.__version__,
            backend=backend,
            world_size=len(records),
            steps_observed=diagnosis.steps_observed,
            ddp_config=dict(info.ddp_config),
            findings=diagnosis.findings,
            recommendation=diagnosis.recommendation,
            timing=diagnosis.timing,
            crashes=diagnosis.crashes,
            framework=info.framework,
            ddp_site=info.ddp_site,
            usage_map=diagnosis.usage_map,
            divergence=diagnosis.divergence,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """The inverse of `to_dict` (the `check` parent reads the ranks' JSON back with it)."""
        findings = [Finding(**{**f, "params": [ParamRef(p["name"], p["numel"], tuple(p.get("shape", ())))
                                                 for p in f["params"]]}) for f in data["findings"]]
        return cls(
            tool_version=data["tool_version"], torch_version=data["torch_version"], backend=data["backend"],
            world_size=data["world_size"], steps_observed=data["steps_observed"], ddp_config=data["ddp_config"],
            findings=findings, recommendation=Recommendation(**data["recommendation"]),
            timing=Timing(**data["timing"]), crashes=[Crash(**c) for c in data.get("crashes", [])],
            framework=data.get("framework", "torch"), ddp_site=data.get("ddp_site"),
            interrupted=bool(data.get("interrupted", False)),
            usage_map=UsageMap.from_dict(data["usage_map"]) if data.get("usage_map") else None,
            divergence=Divergence.from_dict(data["divergence"]) if data.get("divergence") else None)

    @property
    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def finding(self, code: str) -> Finding | None:
        return next((f for f in self.findings if f.code == code), None)

    def crash_lines(self) -> list[str]:
        """One line per distinct crash, ranks grouped: `ranks 0, 1 stopped at step 1: RuntimeError: ....`"""
        by_message: dict[tuple[int, str], list[int]] = {}
        for crash in self.crashes:
            first = crash.message.split(". ", 1)[0].splitlines()[0][:200]
            by_message.setdefault((crash.step, first), []).append(crash.rank)
        return [f"{rank_list(ranks)} stopped at step {step}: {first}." for (step, first), ranks in by_message.items()]

    def worst_severity(self) -> str | None:
        present = {f.severity for f in self.findings}
        return next((s for s in SEVERITIES if s in present), None)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema": self.schema,
            "tool_version": self.tool_version,
            "torch_version": self.torch_version,
            "backend": self.backend,
            "world_size": self.world_size,
            "steps_observed": self.steps_observed,
            "ddp_config": self.ddp_config,
            "findings": [f.to_dict() for f in self.findings],
            "recommendation": self.recommendation.to_dict(),
            "timing": self.timing.to_dict(),
            "crashes": [asdict(c) for c in self.crashes],
            "framework": self.framework,
            "ddp_site": self.ddp_site,
        }
        if self.interrupted:
            out["interrupted"] = True
        # New keys go last and only when present, so every key above stays exactly as it was.
        if self.usage_map is not None:
            out["usage_map"] = self.usage_map.to_dict()
        if self.divergence is not None:
            out["divergence"] = self.divergence.to_dict()
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(finite(self.to_dict()), indent=2, **kwargs)

    def to_html(self) -> str:
        """The report as one self-contained HTML page: findings, both figures, the recommendation as code.

        Needs matplotlib (`pip install 'ddp-doctor[html]'`).

        Example:
            >>> Path("report.html").write_text(doctor.report().to_html())  # doctest: +SKIP
        """
        from ddp_doctor.report.html import to_html

        return to_html(self)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from ddp_doctor.report.text import render

        yield from render(self)

    def __str__(self) -> str:
        from ddp_doctor.report.text import to_text

        return to_text(self)


def finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
