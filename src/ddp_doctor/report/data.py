"""The report as data: the diagnosis of one DDP model with the run's facts around it. `ReportData.build` is the one
constructor of a report; `to_dict()` is the JSON schema (`ddp-doctor/report@2`) and `from_dict` reads it back. The
renderers (`text.py`, `html.py`) read this type; `model.py`'s `Report` draws itself with them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ddp_doctor.core import VERSION
from ddp_doctor.core.codes import CODES, SEVERITIES, Code
from ddp_doctor.core.figures import Divergence, UsageMap
from ddp_doctor.core.findings import Crash, Diagnosis, Finding, Recommendation, Timing, Unchecked, finite
from ddp_doctor.core.following import Following
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.report.words import worded

if TYPE_CHECKING:
    from ddp_doctor.core.records import ModelInfo

__all__ = ["SCHEMA", "ReportData", "RunFacts", "recommendation_words"]

SCHEMA = "ddp-doctor/report@2"
"""`@2` is `@1` with each finding's evidence (`sites`, `measured`, `caused_by`, `explains`) always present; a
reader of `@1` reads it unchanged (docs/json-schema.md)."""

_R = TypeVar("_R", bound="ReportData")


def _reshard_words(reshard: dict[str, Any], framework: str) -> str:
    """The `reshard_after_forward` advice of a sharded model and what its second run showed, from `reshard`."""
    call = f"the fully_shard call at {reshard['site']}" if reshard.get("site") else "in its fully_shard call"
    module, before = reshard.get("module"), reshard.get("all_gathers_per_step")
    shown = reshard.get("verification")
    if reshard.get("withdrawn"):
        if shown.get("error") is not None:
            why = f"failed: {shown['error']}"
        elif not shown.get("same_findings"):
            why = "found other problems than the first"
        else:
            why = f"counted {shown.get('all_gathers_per_step')} all-gathers per step (the first counted {before})"
        return (
            f"Tried and withdrawn: `reshard_after_forward=False` on {module} ({call}); a second run of the script "
            f"with it {why}."
        )
    plugin = (
        " (Accelerate's FSDP2 plugin sets one reshard_after_forward for every module it shards; this advice is for "
        "one module.)"
        if framework in ("accelerate", "transformers")
        else ""
    )
    advice = (
        f"For speed: `reshard_after_forward=False` on {module} ({call}). It is the last sharded module to run "
        "forward, so its backward starts right after its forward: with reshard_after_forward=True FSDP2 frees its "
        f"parameters after the forward and all-gathers them again at once. Kept, each forward and backward make one "
        f"all-gather fewer ({before} per step now) and the step holds that module's unsharded parameters a moment "
        f"longer, which its backward needs anyway (torchtitan does the same for its last block).{plugin}"
    )
    if shown is None:
        return f"{advice} Not yet verified: `ddp-doctor check` applies it in a second run of the script when it can."
    return (
        f"{advice} Verified: a second run of the script with it applied made {shown.get('all_gathers_per_step')} "
        f"all-gathers per step instead of {before}, with the same findings."
    )


def _flags_verdict(shown: dict[str, Any]) -> str:
    """What a second run with the recommended DDP flags showed, from `Recommendation.verification`."""
    tried = f"a second run with these flags (--ddp-kwargs '{shown['ddp_kwargs']}')"
    found = [f"{code} ({CODES.get(code, code)})" for code in shown.get("errors", [])]
    outcome, steps = shown["outcome"], shown.get("steps_observed", 0)
    if outcome == "verified":
        return f"Verified: {tried} observed {steps} step(s) on every rank with no error."
    if outcome == "not-run":
        return f"{tried[0].upper()}{tried[1:]} did not run: {shown.get('error')}."
    if outcome == "refuted":
        why = found[0] if found else "it crashed"
        return (
            f"Refuted: {tried} failed: {why}. No DDP flags can be recommended from these runs; fix the findings "
            "above and run the check again."
        )
    if found:
        return f"Not verified: {tried} ran without DDP's errors, but errors that flags cannot fix remain: {found[0]}."
    return (
        f"Not verified: {tried} did not confirm them: it observed {steps} step(s), fewer than the "
        f"{shown.get('steps_needed')} needed."
    )


def recommendation_words(rec: Recommendation, framework: str = "torch") -> str:
    """The recommendation as the report prints it: for a sharded model the `reshard_after_forward` advice first
    (typed in `reshard`), then the analysis' reason, then what a second run with DDP flags showed (typed in
    `verification`). `framework` built the model (Accelerate's plugin gets a note)."""
    said = [rec.reason]
    if rec.reshard is not None:
        said.insert(0, _reshard_words(rec.reshard, framework))
    if rec.verification is not None:
        said.append(_flags_verdict(rec.verification))
    return " ".join(said)


def _torch_version() -> str:
    import torch  # the facts of a model observed in this process: torch is imported there already

    return torch.__version__


@dataclass(kw_only=True, frozen=True)
class RunFacts:
    """What a report says around its diagnosis: the run's facts, gathered where the run is (the in-rank doctor,
    the supervisor from the ranks' files, the optimizer watch), never decided by the analysis."""

    torch_version: str
    backend: str
    world_size: int
    ddp_config: dict[str, Any]
    """The flags the script built DDP with (empty: no DDP model was built)."""
    framework: str = "torch"
    ddp_site: str | None = None
    interrupted: bool = False
    """`ddp-doctor` was stopped by SIGINT / SIGTERM / SIGHUP before the observed steps ended: a partial report."""
    failed: bool = False
    """The run failed before the ranks could exchange what they saw: a report from each rank's own files."""
    parallelism: str = "ddp"
    """What keeps the replicas in sync in the observed model: `ddp`, `fsdp2` (`fully_shard`) or `replicate` (the
    FSDP2-based one)."""
    sharding: dict[str, Any] | None = None
    """For `fsdp2`: the sharded modules, the mesh, `reshard_after_forward`, the mixed-precision dtypes."""
    tool_version: str = VERSION

    @classmethod
    def of_model(cls, info: ModelInfo, *, world_size: int, backend: str) -> RunFacts:
        """The facts of a DDP model observed in this process (its flags, framework and line from `info`)."""
        return cls(
            torch_version=_torch_version(),
            backend=backend,
            world_size=world_size,
            ddp_config=dict(info.ddp_config),
            framework=info.framework,
            ddp_site=info.ddp_site,
        )


@dataclass(kw_only=True, frozen=True)
class ReportData:
    """The doctor's report as data, identical on every rank: the run's facts (`RunFacts`) around one `Diagnosis`.
    `build` is its one constructor; `to_dict()` is the JSON schema, `from_dict` reads it back. Frozen: a later
    input goes through the analysis to a new diagnosis, and `build` makes a new report of it. The renderers read
    this type; `Report` (`report/model.py`) adds `print(report)` and `to_html()`."""

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
    failed: bool = False
    """The run failed before the ranks could exchange what they saw: a report from each rank's own files."""
    usage_map: UsageMap | None = None
    """Which parameter got a gradient on which rank at which step (JSON key `usage_map`, absent when None)."""
    divergence: Divergence | None = None
    """The largest cross-rank difference of weights and gradients per step (JSON key `divergence`)."""
    following: Following | None = None
    """What `check` followed after the observed steps: the epoch ends, the loaders (JSON key `following`)."""
    parallelism: str = "ddp"
    """What keeps the replicas in sync in the observed model: `ddp`, `fsdp2` (`fully_shard`) or `replicate` (the
    FSDP2-based one)."""
    sharding: dict[str, Any] | None = None
    """For `fsdp2`: the sharded modules, the mesh, `reshard_after_forward`, the mixed-precision dtypes."""
    files_written: list[dict[str, Any]] = field(default_factory=list)
    """Files the script wrote under the check (`torch.save`, `open()` for writing in its own code): `path`,
    `shown`, `site`, `how`, `existed`, `ranks` (JSON key `files_written`, absent when empty)."""
    files_unlisted: int = 0
    """Ranks whose written files are not listed (JSON key `files_unlisted_ranks`, absent when 0)."""
    unchecked: list[Unchecked] = field(default_factory=list)
    """What the check did not run or could not see: JSON `unchecked` the sentences (`@1`), `not_checked` each one's
    key and facts (`@2`); both absent when empty."""
    compared: dict[str, Any] | None = None
    """What the exchange compared across the ranks, with counts (`analyze/coverage.py`; JSON key `compared`)."""
    schema: str = SCHEMA

    @classmethod
    def build(cls: type[_R], facts: RunFacts, diagnosis: Diagnosis) -> _R:
        """The report of `diagnosis` with the run's `facts` around it: the one constructor of a report."""
        return cls(
            tool_version=facts.tool_version,
            torch_version=facts.torch_version,
            backend=facts.backend,
            world_size=facts.world_size,
            steps_observed=diagnosis.steps_observed,
            ddp_config=facts.ddp_config,
            findings=[worded(f) for f in diagnosis.findings],
            recommendation=diagnosis.recommendation,
            timing=diagnosis.timing,
            crashes=diagnosis.crashes,
            framework=facts.framework,
            ddp_site=facts.ddp_site,
            interrupted=facts.interrupted,
            failed=facts.failed,
            usage_map=diagnosis.usage_map,
            divergence=diagnosis.divergence,
            following=diagnosis.following,
            parallelism=facts.parallelism,
            sharding=facts.sharding,
            files_written=diagnosis.files_written,
            files_unlisted=diagnosis.files_unlisted,
            unchecked=diagnosis.unchecked,
            compared=diagnosis.compared,
        )

    @property
    def facts(self) -> RunFacts:
        """The run's facts this report was built with."""
        return RunFacts(
            tool_version=self.tool_version,
            torch_version=self.torch_version,
            backend=self.backend,
            world_size=self.world_size,
            ddp_config=self.ddp_config,
            framework=self.framework,
            ddp_site=self.ddp_site,
            interrupted=self.interrupted,
            failed=self.failed,
            parallelism=self.parallelism,
            sharding=self.sharding,
        )

    @property
    def diagnosis(self) -> Diagnosis:
        """The diagnosis this report was built with (a later input goes through the analysis with it)."""
        return Diagnosis(
            findings=list(self.findings),
            recommendation=self.recommendation,
            timing=self.timing,
            steps_observed=self.steps_observed,
            crashes=list(self.crashes),
            usage_map=self.usage_map,
            divergence=self.divergence,
            following=self.following,
            unchecked=list(self.unchecked),
            files_written=list(self.files_written),
            files_unlisted=self.files_unlisted,
            compared=self.compared,
        )

    @classmethod
    def from_dict(cls: type[_R], data: dict[str, Any]) -> _R:
        """The inverse of `to_dict` (the `check` parent reads the ranks' JSON back with it)."""
        findings = [Finding.from_dict(f) for f in data["findings"]]
        facts = RunFacts(
            tool_version=data["tool_version"],
            torch_version=data["torch_version"],
            backend=data["backend"],
            world_size=data["world_size"],
            ddp_config=data["ddp_config"],
            framework=data.get("framework", "torch"),
            ddp_site=data.get("ddp_site"),
            interrupted=bool(data.get("interrupted", False)),
            failed=bool(data.get("failed", False)),
            parallelism=data.get("parallelism", "ddp"),
            sharding=data.get("sharding"),
        )
        diagnosis = Diagnosis(
            findings=findings,
            recommendation=Recommendation.from_dict(data["recommendation"]),
            timing=Timing.from_dict(data["timing"]),
            steps_observed=data["steps_observed"],
            crashes=[Crash(**c) for c in data.get("crashes", [])],
            usage_map=UsageMap.from_dict(data["usage_map"]) if data.get("usage_map") else None,
            divergence=Divergence.from_dict(data["divergence"]) if data.get("divergence") else None,
            following=Following.from_dict(data["following"]) if data.get("following") else None,
            files_written=list(data.get("files_written", [])),
            files_unlisted=int(data.get("files_unlisted_ranks", 0)),
            unchecked=_unchecked_of(data),
            compared=data.get("compared"),
        )
        return cls.build(facts, diagnosis)

    @property
    def clean_line(self) -> str:
        """The sentence of a report without findings: it claims only what was checked, so a sharded model's report
        (checked for some things only) and one with `unchecked` sentences point below; a failed run compared
        nothing; it is never "No problems found" alone."""
        if self.failed:
            return "The run failed before the ranks could compare what they saw: nothing was compared across ranks."
        if self.compared is not None and not self.compared.get("parameters", 1):
            return "Nothing was compared across ranks, so nothing is claimed (below)."
        if self.compared is not None:
            return "No problems found in what was compared (below)."
        if self.sharding is None and not self.unchecked:  # a report written before reports listed what they compared
            return "No problems found; this report does not list what was compared."
        return "No problems found in what was checked (below)."

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
        # A crash a `rank-crashed` finding names is said there, with its line.
        named = {(r, s) for f in self.findings if f.code == Code.RANK_CRASHED for r in f.ranks for s in f.steps}
        for crash in self.crashes:
            if (crash.rank, max(crash.step, 0)) in named:
                continue
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
            out["unchecked"] = [u.text for u in self.unchecked]
            out["not_checked"] = [u.to_dict() for u in self.unchecked]
        if self.compared is not None:
            out["compared"] = self.compared
        if self.failed:
            out["failed"] = True
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(finite(self.to_dict()), indent=2, **kwargs)


def _unchecked_of(data: dict[str, Any]) -> list[Unchecked]:
    """A report's `unchecked` sentences with their `not_checked` keys and facts (a report written before `@2`
    carried them has the sentences only)."""
    texts, keyed = data.get("unchecked", []), data.get("not_checked") or []
    if len(keyed) != len(texts):
        return [Unchecked("", text) for text in texts]
    return [Unchecked(k["what"], text, {n: v for n, v in k.items() if n != "what"}) for text, k in zip(texts, keyed)]
