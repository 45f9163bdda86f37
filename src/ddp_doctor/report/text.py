"""Terminal rendering with rich. Reads the report's data (`ReportData`); knows nothing about how it was diagnosed."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ddp_doctor.core.findings import Finding, by_cause
from ddp_doctor.core.following import Following
from ddp_doctor.core.ranks import rank_ranges
from ddp_doctor.core.steptime import PHASES, RankTiming
from ddp_doctor.report.claims import compared_line
from ddp_doctor.report.data import ReportData, recommendation_words
from ddp_doctor.report.words import worded

__all__ = ["phases_line", "render", "to_text"]

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_MAX_PARAMS = 6


def _flags(config: dict[str, Any]) -> str:
    keys = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers")
    return ", ".join(f"{k}={config[k]}" for k in keys if k in config)


def _sharding(sharding: dict[str, Any]) -> str:
    """The header's line: `FSDP2: 3 sharded modules (root sharded), mesh [2], reshard_after_forward=True`, or
    `replicate (FSDP2): 3 replicated modules (root replicated), mesh [2]`."""
    n = sharding.get("sharded_modules", 0)
    replicate = sharding.get("api") == "replicate"
    done = "replicated" if replicate else "sharded"
    root = f"root {done}" if sharding.get("root_sharded") else f"root not {done}"
    parts = [f"{'replicate (FSDP2)' if replicate else 'FSDP2'}: {n} {done} module{'s' if n != 1 else ''} ({root})"]
    if sharding.get("mesh"):
        dims = f" ({', '.join(sharding['mesh_dims'])})" if sharding.get("mesh_dims") else ""
        parts.append("mesh " + ", ".join(str(m) for m in sharding["mesh"]) + dims)
    if beside := sharding.get("beside"):  # tensor parallelism: groups of ranks beside the data-parallel mesh
        parts.append(f"beside it {'/'.join(beside['dims'])} groups of {beside['size']} ranks")
    if sharding.get("reshard_after_forward") and not replicate:  # replicate keeps every parameter whole
        parts.append("reshard_after_forward=" + "/".join(str(r) for r in sharding["reshard_after_forward"]))
    dtypes = [f"{k}={'/'.join(sharding[k])}" for k in ("param_dtype", "reduce_dtype") if sharding.get(k)]
    if "param_dtype" in sharding:  # absent where FSDP2's state could not be read
        parts.append("mixed precision " + ", ".join(dtypes) if dtypes else "no mixed precision")
    return ", ".join(parts)


def _finding(f: Finding, consequences: list[Finding] = ()) -> Panel:
    # A Panel's title is one line, cut at the terminal's width: the border names the finding (severity and code,
    # short), and the title is the body's first line, where it wraps like the rest.
    body = Text()
    body.append(f.title + "\n", style="bold")
    body.append(f.detail + "\n")
    if f.params:
        shown = ", ".join(str(p) for p in f.params[:_MAX_PARAMS])
        more = f" and {len(f.params) - _MAX_PARAMS} more" if len(f.params) > _MAX_PARAMS else ""
        body.append("params: ", style="bold").append(shown + more + "\n")
    if f.ranks or f.steps:
        ranks = rank_ranges(f.ranks, more=f.more_ranks) if f.ranks else "none"
        label = "rank" if len(f.ranks) == 1 and not f.more_ranks else "ranks"
        steps = f"; steps {f.steps}" if f.steps else ""  # none: seen after the observed steps (following)
        body.append("seen: ", style="bold").append(f"{label} {ranks}{steps}\n")
    if f.fix:  # empty when the script's flags already are the fix (an `info` finding): nothing to do
        body.append("fix: ", style="bold green").append(f.fix + "\n")
    if consequences:
        body.append("what followed from it:\n", style="bold")
        for c in consequences:
            seen = _seen(c)
            body.append(f"  {c.severity} ", style=_STYLE[c.severity]).append(f"{c.code}: ", style="bold")
            body.append(f"{c.title}{f' ({seen})' if seen else ''}\n")
    body.rstrip()
    title = Text.assemble((f.severity.upper(), _STYLE[f.severity]), " ", (f.code, "bold"))
    if consequences:
        title.append(f" (+{len(consequences)} that follow from it)", style="dim")
    return Panel(body, title=title, title_align="left", border_style=_STYLE[f.severity])


def finding_sentences(f: Finding) -> str:
    """One finding as plain sentences (its title, detail and fix, written from its evidence where the report writes
    them), for an error message that carries it."""
    f = worded(f)
    return " ".join(part.rstrip(".") + "." for part in (f.title, f.detail, f.fix) if part)


def _seen(f: Finding) -> str:
    """`ranks 0, 1; steps [1]`: where a consequence was seen, in one line."""
    ranks = f"ranks {rank_ranges(f.ranks, more=f.more_ranks)}" if f.ranks else ""
    steps = f"steps {f.steps}" if f.steps else ""
    return "; ".join(p for p in (ranks, steps) if p)


def _head(report: ReportData) -> Group:
    """The run's facts, two pairs a row; values wrap (a long path folds onto the next lines instead of being cut)."""
    key_width = len("steps observed")
    head = Table.grid(padding=(0, 2))
    head.add_column(min_width=key_width, no_wrap=True)
    head.add_column(overflow="fold")
    head.add_column(no_wrap=True)
    head.add_column(overflow="fold")
    head.add_row("world size", str(report.world_size), "backend", report.backend)
    head.add_row("steps observed", str(report.steps_observed), "torch", report.torch_version)
    if report.sharding is not None:
        head.add_row("parallelism", _sharding(report.sharding), "built by", report.framework)
    else:
        head.add_row(
            "DDP flags", _flags(report.ddp_config) or "none (no DDP model was built)", "built by", report.framework
        )
    parts: list[Any] = [head]
    if report.ddp_site:
        # On a row of its own, so the path has the whole width before it folds.
        where = Table.grid(padding=(0, 2))
        where.add_column(min_width=key_width, no_wrap=True)
        where.add_column(overflow="fold")
        where.add_row("DDP built at", report.ddp_site)
        parts.append(where)
    return Group(*parts)


def _recommendation(report: ReportData) -> Panel:
    rec = report.recommendation
    if not report.ddp_built or not rec.flags_known:
        # No DDP model, or nothing observed supports flags (they are None): only the reason applies.
        title = "No DDP flags to recommend" if report.sharding is None else "Recommendation"
        return Panel(
            Text(recommendation_words(rec, report.framework)), title=title, title_align="left", border_style="green"
        )
    summary = Text()
    summary.append(
        f"find_unused_parameters={rec.find_unused_parameters}, static_graph={rec.static_graph}, "
        f"gradient_as_bucket_view={rec.gradient_as_bucket_view}",
        style="bold",
    )
    if rec.freeze_before_wrap:
        summary.append(f"\nfreeze before wrap: {', '.join(rec.freeze_before_wrap)}")
    summary.append(f"\n{recommendation_words(rec, report.framework)}")
    first = "torch" if report.framework not in rec.render else report.framework
    parts: list[Any] = [summary]
    if first in rec.render:
        parts.append(Syntax(rec.render[first], "python", theme="ansi_dark", background_color="default", word_wrap=True))
    verdict = "verified" if rec.verified else "not yet verified"
    return Panel(Group(*parts), title=f"Recommendation ({verdict})", title_align="left", border_style="green")


def render(report: ReportData) -> Iterator[Any]:
    """Yield rich renderables for the report, top to bottom."""
    yield Panel(_head(report), title=f"ddp-doctor {report.tool_version}", title_align="left")

    for line in report.crash_lines():
        yield Text(line, style="red")
    if report.interrupted and not report.findings:
        yield Text(
            f"Interrupted after {report.steps_observed} observed step(s): nothing was diagnosed.", style="yellow"
        )
    elif not report.findings:
        clean = report.clean_line
        yield Text(clean, style="bold green")
    for cause, consequences in by_cause(report.findings):
        yield _finding(cause, consequences)
    if report.files_written:
        yield Text("\n".join(files_lines(report)), style="yellow")
    if report.compared is not None:
        yield Text(compared_line(report.compared), style="dim")
    for u in report.unchecked:
        yield Text(f"Not checked: {u.text}", style="yellow")

    yield _recommendation(report)

    t = report.timing
    if t.step_s is not None:
        yield Text(
            f"median per step (observed, hooks included): forward {t.forward_s * 1e3:.1f} ms, backward "
            f"{t.backward_s * 1e3:.1f} ms, optimizer {t.optimizer_s * 1e3:.1f} ms",
            style="dim",
        )
    if t.per_rank:
        yield Text(phases_line(t.per_rank), style="dim")
    if report.following is not None:
        yield from (Text(line, style="dim") for line in following_lines(report.following))


def files_lines(report: ReportData) -> list[str]:
    """The files the script wrote under the check, and that its next run will find them."""
    files = report.files_written
    head = (
        f"The script wrote {len(files)} file(s) while under the check. They stay behind, and the script will find "
        "them on its next run: a script that resumes from a snapshot or checkpoint it finds starts where the check "
        f"stopped it ({report.steps_observed} observed step(s), then any capped epoch the check followed) instead "
        "of from scratch, and a log goes on from the check's lines. Delete them (or point the script elsewhere) "
        "before the real run:"
    )
    lines = [head]
    for w in files:
        ranks = rank_ranges(w.get("ranks", []), more=w.get("more_ranks", 0)) if w.get("ranks") else "?"
        state = "overwritten or appended to" if w.get("existed") else "created"
        at = f" at {w['site']}" if w.get("site") else ""
        lines.append(f"  {w['shown']} ({w['how']}{at}, rank(s) {ranks}; {state})")
    if report.files_unlisted:
        lines.append(f"  and the files of {report.files_unlisted} more rank(s) that wrote other ones")
    return lines


def following_lines(f: Following) -> list[str]:
    """What `check` followed after the observed steps: the epoch ends, then one line per loader."""
    if not f.epochs and not f.note:
        return []
    if not f.epoch_ends and f.note:
        head = f.note
    else:
        head = (
            f"followed {f.epoch_ends} epoch end(s) after the observed steps in {f.seconds:.1f} s, every later "
            f"DataLoader pass capped at {f.limit_batches} batch(es); what ended it: {f.ended_by}. {f.note}".rstrip()
        )
    lines = [head]
    for d in f.loaders[:8]:
        b = d["batches"]
        if b["min"] is None and b["max"] is None:
            length = "no len()"
        elif b["min"] == b["max"]:
            length = f"{b['max']} batches"
        else:
            length = f"{b['min']}-{b['max']} batches by rank"
        role = "training" if d["training"] else "evaluation or other"
        name = f"#{d['ordinal']} " if d.get("ordinal", 1) > 1 else ""
        c = d.get("counted") or {}
        counted = ""
        if c.get("pass"):
            spread = f"{c['min']}" if c["min"] == c["max"] else f"{c['min']}-{c['max']}"
            counted = f"; pass {c['pass']} counted {spread} batches per rank"
        lines.append(
            f"  loader {name}{d['site'] or '(unknown line)'} ({role}, {d.get('sampler') or 'no sampler'}): real "
            f"length {length}; {d['passes']} pass(es), at most {d['most']} batches handed out, {d['capped']} capped"
            f"{counted}"
        )
    if len(f.loaders) > 8:
        lines.append(f"  and {len(f.loaders) - 8} more loader(s)")
    return lines


def phases_line(per_rank: list[RankTiming]) -> str:
    """One line: each rank's median step split into phases (the slowest and the fastest only, beyond 4 ranks); on
    GPUs its wait for data and its step, on the GPU's clock."""
    shown = per_rank
    if len(per_rank) > 4:
        by_own = sorted(per_rank, key=lambda r: r.own_s)
        shown = [by_own[-1], by_own[0]]
    gpu = all(r.gpu_clock for r in per_rank)
    phases = ("data_wait_s", "step_s") if gpu else PHASES
    parts = [
        f"rank {r.rank}{' (slowest)' if len(shown) < len(per_rank) and i == 0 else ''}"
        f"{' (fastest)' if len(shown) < len(per_rank) and i == 1 else ''} "
        + "/".join(f"{r.median[p] * 1e3:.1f}" for p in phases)
        for i, r in enumerate(shown)
    ]
    if gpu:
        return (
            "step per rank on the GPU's clock, ms (GPU idle waiting for data/step): " + "; ".join(parts) + " (a "
            "straggler rank is not checked on GPUs: the waits in NCCL's all-reduce are not timed)"
        )
    return "step per rank, ms (data wait/forward/backward/all-reduce wait/optimizer): " + "; ".join(parts)


def to_text(report: ReportData, *, width: int = 100, color: bool = False) -> str:
    """The report as a string; plain text unless `color`."""
    buffer = io.StringIO()
    console = Console(
        file=buffer, width=width, force_terminal=color, color_system="standard" if color else None, highlight=False
    )
    for part in render(report):
        console.print(part)
    return buffer.getvalue()
