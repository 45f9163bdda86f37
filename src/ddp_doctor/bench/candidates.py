"""The DDP configurations `ddp-doctor bench` tries, built from what the check learned about the used set."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ddp_doctor.core.codes import Code
from ddp_doctor.report.model import Report

__all__ = ["DEFAULT_BUCKET_MB", "Config", "candidates"]

DEFAULT_BUCKET_MB = 25.0
"""DDP's default bucket_cap_mb."""
_BUCKET_ALTERNATIVES = (10.0, 50.0)


@dataclass(frozen=True, kw_only=True)
class Config:
    """One DDP configuration: constructor flags plus the parameters frozen before wrapping."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = DEFAULT_BUCKET_MB
    freeze_before_wrap: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def of_report(cls, report: Report) -> Config:
        """The configuration the script itself used."""
        cfg = report.ddp_config
        return cls(
            find_unused_parameters=bool(cfg.get("find_unused_parameters")),
            static_graph=bool(cfg.get("static_graph")),
            gradient_as_bucket_view=bool(cfg.get("gradient_as_bucket_view")),
            bucket_cap_mb=float(cfg.get("bucket_cap_mb") or DEFAULT_BUCKET_MB),
        )

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        return {
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "bucket_cap_mb": self.bucket_cap_mb,
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["freeze_before_wrap"] = list(self.freeze_before_wrap)
        return d


def candidates(report: Report) -> list[tuple[str, Config]]:
    """The user's configuration, the recommendation, and every other flag combination that could be correct.

    What the check saw rules combinations out only where DDP is known to fail: find_unused_parameters=True with
    parameters used outside forward or under reentrant checkpointing; static_graph=True when the used set changes
    between steps; both off when some parameter got no gradient. The rest is up to the runs to prove.
    """
    user = Config.of_report(report)
    rec = report.recommendation
    # A recommendation without flags (null in the JSON: the check's run failed before anything supported flags)
    # leaves the user's flags as the recommended candidate, which the dedup below folds into "user".
    recommended = Config(
        find_unused_parameters=rec.find_unused_parameters if rec.flags_known else user.find_unused_parameters,
        static_graph=rec.static_graph if rec.flags_known else user.static_graph,
        gradient_as_bucket_view=rec.gradient_as_bucket_view if rec.flags_known else user.gradient_as_bucket_view,
        bucket_cap_mb=user.bucket_cap_mb,
        freeze_before_wrap=tuple(rec.freeze_before_wrap),
    )
    codes = report.codes
    dynamic = bool(codes & {Code.DYNAMIC_GRAPH, Code.STATIC_GRAPH_UNSAFE, Code.FROZEN_AFTER_WRAP})
    hidden = bool(codes & {Code.USED_OUTSIDE_FORWARD, Code.REENTRANT_CHECKPOINT})
    unused = bool(codes & {Code.UNUSED_PARAMETERS, Code.RANK_DEPENDENT_GRAPH, Code.REDUCTION_ERROR}) or dynamic
    out: list[tuple[str, Config]] = [("user", user), ("recommended", recommended)]
    flags = {
        "defaults": (False, False, not unused),
        "find_unused": (True, False, not hidden),
        "static_graph": (False, True, not dynamic),
    }
    for name, (find_unused, static, plausible) in flags.items():
        if plausible:
            out.append(
                (name, replace(user, find_unused_parameters=find_unused, static_graph=static, freeze_before_wrap=()))
            )
    out.append(
        (
            "recommended+bucket_view",
            replace(recommended, gradient_as_bucket_view=not recommended.gradient_as_bucket_view),
        )
    )
    for mb in _BUCKET_ALTERNATIVES:
        if mb != recommended.bucket_cap_mb:
            out.append((f"recommended+bucket_{mb:g}mb", replace(recommended, bucket_cap_mb=mb)))
    unique: list[tuple[str, Config]] = []
    for name, config in out:
        if all(config != seen for _, seen in unique):
            unique.append((name, config))
    return unique
