"""Turn what the ranks left in the node's output folder into the check's result.

When the ranks exchanged their records, `report.json` holds the full reports. When they could not (a rank crashed
alone, or hung), each rank's own files still say how it ended; the result then names the rank that failed, its
step, its error or where it was stuck, and what the other ranks were waiting in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.codes import SEVERITIES
from ddp_doctor.report.model import Finding, ParamRef, Recommendation, Report, Timing, finite

__all__ = ["CheckResult", "Model", "collect", "exit_code"]


@dataclass(kw_only=True)
class Model:
    """One observed DDP model and its report."""

    report: Report
    site: str | None = None
    framework: str = "torch"
    module: str = ""


@dataclass(kw_only=True)
class CheckResult:
    """Everything a `check` run produced on this node."""

    models: list[Model] = field(default_factory=list)
    error: str | None = None
    """Set when the tool could not run the script at all (exit code 2)."""
    timed_out: bool = False
    step_times: list[float] | None = None
    """Unobserved optimizer-step times after the report (`ddp-doctor bench`), from this node's local rank 0."""
    late_crash: str | None = None
    """An error raised after the report was written (during the timed steps)."""

    @property
    def report(self) -> Report | None:
        return self.models[0].report if self.models else None

    def to_json(self) -> str:
        return json.dumps(finite(self.to_dict()), indent=2)

    def to_dict(self) -> dict[str, Any]:
        """The first model's report (schema `ddp-doctor/report@1`); further models go under `other_models`."""
        if not self.models:
            return {"schema": "ddp-doctor/report@1", "error": self.error, "findings": []}
        first, *rest = self.models
        out = {**first.report.to_dict(), "model": first.module}
        if rest:
            out["other_models"] = [{**m.report.to_dict(), "model": m.module} for m in rest]
        return out


def exit_code(result: CheckResult, fail_on: str) -> int:
    """0: nothing at or above `fail_on`; 1: findings at or above it; 2: the tool could not run."""
    if result.error is not None or not result.models:
        return 2
    if fail_on == "never":
        return 0
    limit = SEVERITIES.index(fail_on)
    worst = [m.report.worst_severity() for m in result.models]
    return int(any(w is not None and SEVERITIES.index(w) <= limit for w in worst))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(outdir: Path, *, timed_out: bool, torchrun_rc: int | None) -> CheckResult:
    """Read the output folder after every rank has ended."""
    full = _read(outdir / "report.json")
    if full is not None:
        models = [Model(report=Report.from_dict(m["report"]), site=m.get("site"), framework=m.get("framework", "torch"),
                        module=m.get("module", "")) for m in full["models"]]
        timing = _read(outdir / "timing.json")
        late = [f"rank {d['rank']}: {d['crash']['type']}: {d['crash']['message'][:300]}"
                for p in sorted(outdir.glob("rank*.json")) if not p.name.endswith(".progress.json")
                if (d := _read(p)) is not None and d.get("outcome") == "crashed-after-report"]
        return CheckResult(models=models, timed_out=timed_out, step_times=timing["step_s"] if timing else None,
                           late_crash="; ".join(late) or None)

    ends = {d["rank"]: d for p in outdir.glob("rank*.json") if not p.name.endswith(".progress.json")
            if (d := _read(p)) is not None}
    progress = {d["rank"]: d for p in outdir.glob("rank*.progress.json") if (d := _read(p)) is not None}
    ranks = sorted(set(ends) | set(progress))
    if not ranks:
        return CheckResult(error=f"the script did not start on any rank (torchrun exit code {torchrun_rc}); "
                                 "its output above says why.", timed_out=timed_out)
    built = [r for r in ranks if max(ends.get(r, {}).get("ddp_models", 0), progress.get(r, {}).get("ddp_models", 0))]
    crashed = {r: ends[r]["crash"] for r in ranks if ends.get(r, {}).get("outcome") == "crashed"}
    if not built:
        if crashed:
            rank, crash = min(crashed.items())
            return CheckResult(error=f"the script failed on rank {rank} before it built a DDP model: "
                                     f"{crash['type']}: {crash['message']}\n{crash['traceback']}", timed_out=timed_out)
        if timed_out:
            return CheckResult(error="the script built no DistributedDataParallel model before the timeout "
                                     f"(ranks {ranks} were still running). Raise --timeout if its start-up is slow.",
                               timed_out=True)
        return CheckResult(error="the script ran to the end without building a "
                                 "torch.nn.parallel.DistributedDataParallel model, so there was nothing to observe. "
                                 "Check that it wraps its model in DDP when launched with torchrun (for example, "
                                 "that it does not fall back to single-process training when WORLD_SIZE is set).",
                           timed_out=timed_out)
    return CheckResult(models=[Model(report=_failure_report(ends, progress, crashed, timed_out))],
                       timed_out=timed_out)


_PHASES = ("before DDP was built", "before the first step", "between steps", "forward",
           "after forward, before backward", "backward", "after backward", "optimizer step")


def _where(p: dict[str, Any]) -> str:
    frame = p.get("user_frame") or p.get("site") or p.get("innermost") or "an unknown place"
    return f"step {max(p.get('step', 0), 0)}, {p.get('phase', '?')}, at {frame}"


def _list(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _failure_report(ends: dict[int, dict[str, Any]], progress: dict[int, dict[str, Any]],
                    crashed: dict[int, dict[str, Any]], timed_out: bool) -> Report:
    """A report from the ranks' own files: who failed first, how, and where the others were."""
    from ddp_doctor import __version__

    ranks = sorted(set(ends) | set(progress))
    world = max([d.get("world_size", 1) for d in (*ends.values(), *progress.values())] + [len(ranks)])
    meta = next((d["models"][0] for d in (*ends.values(), *progress.values()) if d.get("models")), {})
    causes = {r: c for r, c in crashed.items() if not c.get("peer_lost")}
    # A rank with no end record died without Python noticing: killed by a signal (out of memory, say), or stopped
    # by the launcher after another rank failed, or by the timeout.
    silent = [r for r in ranks if r not in ends]
    vanished = silent if not causes and not timed_out else []
    findings: list[Finding] = []

    def others(culprits: list[int]) -> str:
        parts = []
        for r in ranks:
            if r in culprits:
                continue
            if r in crashed:
                parts.append(f"rank {r} lost its peer at {_where({**progress.get(r, {}), **crashed[r]})}")
            elif r in progress and not progress[r].get("ended"):
                parts.append(f"rank {r} was at {_where(progress[r])}")
        return "; ".join(parts)

    for rank, crash in sorted(causes.items()):
        explained = crash.get("explained")
        step = max(crash.get("step", 0), 0)
        waiting = others(list(causes))
        if explained:
            findings.append(Finding(
                code=explained["code"], severity="error",
                title=f"rank {rank}: DDP failed at step {step}", detail=explained["message"],
                params=[ParamRef(n, 0) for n in explained.get("params", [])], ranks=[rank], steps=[step],
                fix="see the explanation above; run the check again once it is fixed to see the full diagnosis."))
            continue
        findings.append(Finding(
            code="rank-crashed", severity="error",
            title=f"rank {rank} crashed at step {step}: {crash['type']}: {crash['message'][:200]}",
            detail=(f"Raised at {crash.get('site') or 'an unknown place'} ({crash.get('phase', '?')}); its traceback "
                    "was printed above." + (f" The other ranks were stopped while waiting for it: {waiting}."
                                            if waiting else "")),
            ranks=[rank], steps=[step],
            fix="fix the error on that rank; the rest of the diagnosis needs every rank to finish its steps."))
    if vanished:
        findings.append(Finding(
            code="rank-crashed", severity="error",
            title=f"{_list(vanished)} died without a Python error",
            detail=("It was killed by a signal (the kernel's out-of-memory killer, or a scheduler) at "
                    + "; ".join(f"rank {r}: {_where(progress[r])}" for r in vanished if r in progress)
                    + (f". The others: {others(vanished)}." if others(vanished) else ".")),
            ranks=vanished, steps=sorted({max(progress[r].get("step", 0), 0) for r in vanished if r in progress}),
            fix="check the system log (dmesg) and the memory use of that rank."))
    if not causes and not vanished:
        waiting = [r for r in ranks if r in progress and not progress[r].get("ended")]
        order = {r: (progress[r].get("step", 0),
                     _PHASES.index(progress[r]["phase"]) if progress[r].get("phase") in _PHASES else 0)
                 for r in waiting}
        behind = min(order.values(), default=(0, 0))
        stuck = sorted(r for r, key in order.items() if key == behind)
        missing = [r for r in range(world) if r not in ranks]
        findings.append(Finding(
            code="rank-hung", severity="error",
            title=f"{_list(stuck)} stopped making progress" + (" before the timeout" if timed_out else ""),
            detail=("; ".join(f"rank {r} was at {_where(progress[r])}" for r in sorted(order)) + "."
                    + (" The ranks ahead were waiting for the ones behind in a collective."
                       if len(stuck) < len(order) else "")
                    + (f" {_list(missing)} ran on another node; that node's report covers them." if missing else "")),
            ranks=stuck, steps=sorted({max(progress[r].get("step", 0), 0) for r in stuck}),
            fix="look at what the stuck rank does at that line: a collective that only some ranks call, a loop with "
                "a different number of iterations per rank, or a data source that blocks."))
    ddp_config = meta.get("ddp_config", {})
    rec = Recommendation(
        find_unused_parameters=bool(ddp_config.get("find_unused_parameters", False)),
        static_graph=bool(ddp_config.get("static_graph", False)),
        gradient_as_bucket_view=bool(ddp_config.get("gradient_as_bucket_view", False)),
        freeze_before_wrap=[], verified=False,
        reason="No recommendation: the ranks could not finish the observed steps together, so the used set is not "
               "known on every rank. Fix the failure above and run the check again.")
    steps = [max(d.get("step", 0), 0) for d in progress.values()]
    return Report(
        tool_version=__version__, torch_version=meta.get("torch_version", ""), backend=meta.get("backend", ""),
        world_size=world, steps_observed=min(steps, default=0), ddp_config=ddp_config, findings=findings,
        recommendation=rec, timing=Timing(), framework=meta.get("framework", "torch"), ddp_site=meta.get("site"))
