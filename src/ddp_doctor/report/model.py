"""The report: the diagnosis of one DDP model with the run's facts around it. `to_dict()` is the JSON schema
(`ddp-doctor/report@1`); `print(report)` and `to_html()` hand it to the renderers (`text.py`, `html.py`)."""

from __future__ import annotations

import json
from collections.abc import Sized
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ddp_doctor.analyze.snippets import render_snippets
from ddp_doctor.core import VERSION
from ddp_doctor.core.codes import SEVERITIES
from ddp_doctor.core.figures import Divergence, UsageMap
from ddp_doctor.core.findings import Crash, Diagnosis, Finding, ParamRef, Recommendation, Timing, finite
from ddp_doctor.core.followed import Following
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.report import html, text

__all__ = ["SCHEMA", "Report"]

SCHEMA = "ddp-doctor/report@1"


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
    following: Following | None = None
    """What `check` followed after the observed steps: the epoch ends, the loaders (JSON key `following`)."""
    parallelism: str = "ddp"
    """What keeps the replicas in sync in the observed model: `ddp`, or `fsdp2` (`fully_shard`)."""
    sharding: dict[str, Any] | None = None
    """For `fsdp2`: the sharded modules, the mesh, `reshard_after_forward`, the mixed-precision dtypes."""
    files_written: list[dict[str, Any]] = field(default_factory=list)
    """Files the script wrote under the check (`torch.save`, `open()` for writing in its own code): `path`,
    `shown`, `site`, `how`, `existed`, `ranks` (JSON key `files_written`, absent when empty)."""
    files_unlisted: int = 0
    """Ranks whose written files are not listed (JSON key `files_unlisted_ranks`, absent when 0)."""
    unchecked: list[str] = field(default_factory=list)
    """What the check did not run or could not see, in sentences (JSON key `unchecked`, absent when empty)."""
    schema: str = SCHEMA

    @classmethod
    def build(cls, info: Any, records: Sized, diagnosis: Diagnosis, *, backend: str) -> Report:
        """The report of one DDP model: `records` counts the ranks (any sized collection: a range at scale)."""
        # The code for the recommendation is rendered here, from the records alone: the flavour (which Lightning
        # package, which TrainingArguments fields) was recorded where the model was built.
        diagnosis.recommendation.render = render_snippets(diagnosis.recommendation, info.ddp_config, info.flavor)
        return cls(
            tool_version=VERSION,
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
        findings = [
            Finding(
                **{**f, "params": [ParamRef(p["name"], p["numel"], tuple(p.get("shape", ()))) for p in f["params"]]}
            )
            for f in data["findings"]
        ]
        return cls(
            tool_version=data["tool_version"],
            torch_version=data["torch_version"],
            backend=data["backend"],
            world_size=data["world_size"],
            steps_observed=data["steps_observed"],
            ddp_config=data["ddp_config"],
            findings=findings,
            recommendation=Recommendation.from_dict(data["recommendation"]),
            timing=Timing.from_dict(data["timing"]),
            crashes=[Crash(**c) for c in data.get("crashes", [])],
            framework=data.get("framework", "torch"),
            ddp_site=data.get("ddp_site"),
            interrupted=bool(data.get("interrupted", False)),
            usage_map=UsageMap.from_dict(data["usage_map"]) if data.get("usage_map") else None,
            divergence=Divergence.from_dict(data["divergence"]) if data.get("divergence") else None,
            following=Following.from_dict(data["following"]) if data.get("following") else None,
            parallelism=data.get("parallelism", "ddp"),
            sharding=data.get("sharding"),
            files_written=list(data.get("files_written", [])),
            files_unlisted=int(data.get("files_unlisted_ranks", 0)),
            unchecked=list(data.get("unchecked", [])),
        )

    @property
    def ddp_built(self) -> bool:
        """Whether the run built a DDP model: only then are there DDP flags to show or recommend (a report of a
        script that never wrapped its model, or whose ranks failed before wrapping it, has no `ddp_config`)."""
        return bool(self.ddp_config)

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
            "parallelism": self.parallelism,
        }
        if self.sharding is not None:
            out["sharding"] = self.sharding
        if self.interrupted:
            out["interrupted"] = True
        # New keys go last and only when present, so every key above stays exactly as it was.
        if self.usage_map is not None:
            out["usage_map"] = self.usage_map.to_dict()
        if self.divergence is not None:
            out["divergence"] = self.divergence.to_dict()
        if self.following is not None:
            out["following"] = self.following.to_dict()
        if self.files_written:
            out["files_written"] = self.files_written
        if self.files_unlisted:
            out["files_unlisted_ranks"] = self.files_unlisted
        if self.unchecked:
            out["unchecked"] = self.unchecked
        return out

    def add_following(self, following: Following | None, findings: list[Finding]) -> None:
        """Add what following the script through its epoch ends found (`check`), findings in severity order."""
        self.following = following
        if not findings:
            return
        order = {s: i for i, s in enumerate(SEVERITIES)}
        self.findings = sorted([*self.findings, *findings], key=lambda f: order.get(f.severity, len(order)))

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(finite(self.to_dict()), indent=2, **kwargs)

    def to_html(self) -> str:
        """The report as one self-contained HTML page: findings, both figures, the recommendation as code.

        Needs matplotlib (`pip install 'ddp-doctor[html]'`).

        Example:
            >>> Path("report.html").write_text(doctor.report().to_html())  # doctest: +SKIP
        """
        return html.to_html(self)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from text.render(self)

    def __str__(self) -> str:
        return text.to_text(self)
