"""HTML rendering: the check report as one self-contained page (no network reference), or as a section that other
pages (`bench --html`, `demo --html`'s pages) embed. Reads the report's data (`ReportData`); knows nothing about
how it was diagnosed."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddp_doctor.core.figures import STATE_HELP, STATES
from ddp_doctor.core.findings import Finding, by_cause
from ddp_doctor.core.ranks import rank_ranges
from ddp_doctor.report.claims import compared_line
from ddp_doctor.report.data import ReportData, recommendation_words
from ddp_doctor.report.text import files_lines, following_lines, phases_line

__all__ = ["CSS", "SCRIPT", "IndexEntry", "check_section", "index_page", "page", "to_html"]

FRAMEWORKS = ("torch", "transformers", "accelerate", "lightning")
_MAX_PARAMS = 6

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 80em; }
.ddp-check table.head td { padding: 0.1em 1.2em 0.1em 0; border: none; }
.ddp-check table.head td.key { color: #666; }
.finding { border-left: 0.35em solid #999; background: #fafafa; margin: 1em 0; padding: 0.4em 1em; }
.finding.error { border-color: #b00020; } .finding.warning { border-color: #d68400; }
.finding.info { border-color: #00639b; }
.finding h3 { margin: 0.3em 0; font-size: 1.05em; }
.finding p { white-space: pre-line; }
.sev { font-weight: bold; margin-right: 0.4em; }
.error .sev, .crash { color: #b00020; } .warning .sev { color: #a15c00; } .info .sev { color: #00639b; }
.finding .fix b { color: #1b5e20; }
.clean { color: #1b5e20; font-weight: bold; }
.note { color: #555; }
figure { margin: 1.5em 0; overflow-x: auto; }
figure svg { max-width: 100%; height: auto; }
figcaption { color: #444; font-size: 0.9em; max-width: 70em; }
figcaption dl { display: grid; grid-template-columns: max-content auto; gap: 0.1em 0.8em; }
figcaption dt { font-weight: bold; }
figcaption dd { margin: 0; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; vertical-align: middle; border: 1px solid #999;
          margin-right: 0.3em; }
.recommendation { border: 1px solid #2e7d32; border-radius: 4px; padding: 0.5em 1em; margin: 1em 0; }
.tabs > input { position: absolute; opacity: 0; }
.tabs > label { display: inline-block; padding: 0.3em 1em; border: 1px solid #ccc; border-bottom: none;
                cursor: pointer; background: #f0f0f0; }
.tabs > input:checked + label { background: #fff; font-weight: bold; }
.tabs > div.panel { display: none; border: 1px solid #ccc; padding: 0.5em; position: relative; }
.tabs > input:nth-of-type(1):checked ~ div.panel:nth-of-type(1),
.tabs > input:nth-of-type(2):checked ~ div.panel:nth-of-type(2),
.tabs > input:nth-of-type(3):checked ~ div.panel:nth-of-type(3),
.tabs > input:nth-of-type(4):checked ~ div.panel:nth-of-type(4) { display: block; }
button.copy { position: absolute; right: 0.8em; top: 0.8em; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
.timing { color: #666; }
table.index { border-collapse: collapse; margin: 1em 0; }
table.index th, table.index td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }
"""

SCRIPT = """
document.addEventListener("click", function (event) {
  var button = event.target.closest("button.copy");
  if (!button) { return; }
  var code = button.parentElement.querySelector("code");
  var done = function () {
    button.textContent = "Copied";
    setTimeout(function () { button.textContent = "Copy"; }, 1500);
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(code.textContent).then(done, function () {});
    return;
  }
  var range = document.createRange();
  range.selectNodeContents(code);
  var selection = window.getSelection();
  selection.removeAllRanges();
  selection.addRange(range);
  if (document.execCommand("copy")) { done(); }
});
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def page(title: str, body: str) -> str:
    """A complete page around `body`, with the shared style and script inline (nothing is fetched).

    Args:
        title: the page's title.
        body: HTML for the body, already escaped where it holds text.

    Returns:
        The page as a string.
    """
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{CSS}</style></head>\n<body>\n{body}\n<script>{SCRIPT}</script>\n</body></html>\n"
    )


def to_html(report: ReportData, *, title: str = "ddp-doctor check") -> str:
    """One report as a complete page (what `Report.to_html()` returns).

    Args:
        report: the report to draw.
        title: the page's title and heading.

    Returns:
        A self-contained HTML page: header, findings, usage map, divergence curve, recommendation.

    Example:
        >>> Path("report.html").write_text(to_html(doctor.report()))  # doctest: +SKIP
    """
    return page(title, f"<h1>{_e(title)}</h1>\n{check_section(report)}")


def _flags(config: dict) -> str:
    keys = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers")
    return ", ".join(f"{k}={config[k]}" for k in keys if k in config)


def _head(report: ReportData) -> str:
    cells = [
        ("world size", report.world_size),
        ("backend", report.backend),
        ("steps observed", report.steps_observed),
        ("torch", report.torch_version),
        ("DDP flags", _flags(report.ddp_config) or "-"),
        ("built by", report.framework),
    ]
    if report.ddp_site:
        cells.append(("DDP built at", report.ddp_site))
    rows = "".join(f"<tr><td class='key'>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in cells)
    return f"<table class='head'>{rows}</table>"


def _params(f: Finding) -> str:
    if not f.params:
        return ""
    shown = ", ".join(f"<code>{_e(p.name)}</code> ({p.size})" for p in f.params[:_MAX_PARAMS])
    rest = f.params[_MAX_PARAMS:]
    more = (
        (
            f"<details><summary>and {len(rest)} more</summary>"
            + ", ".join(f"<code>{_e(p.name)}</code> ({p.size})" for p in rest)
            + "</details>"
        )
        if rest
        else ""
    )
    return f"<p><b>params:</b> {shown}{more}</p>"


def _finding(f: Finding, consequences: list[Finding] = ()) -> str:
    """A finding; the findings that follow from it (`Finding.caused_by`) nested under it."""
    ranks = rank_ranges(f.ranks, more=f.more_ranks) if f.ranks else "none"
    seen = f"<p><b>seen:</b> ranks {_e(ranks)}; steps {_e(f.steps)}</p>" if f.ranks or f.steps else ""
    fix = f"<p class='fix'><b>fix:</b> {_e(f.fix)}</p>" if f.fix else ""
    followed = (
        f"<details class='followed'><summary>what followed from it ({len(consequences)})</summary>"
        + "".join(_finding(c) for c in consequences)
        + "</details>"
        if consequences
        else ""
    )
    return (
        f"<article class='finding {f.severity}' data-code='{_e(f.code)}'>"
        f"<h3><span class='sev'>{f.severity.upper()}</span><code>{_e(f.code)}</code> "
        f"<span class='title'>{_e(f.title)}</span></h3>"
        f"<p>{_e(f.detail)}</p>{_params(f)}{seen}{fix}{followed}</article>"
    )


def _status(report: ReportData) -> str:
    parts = []
    for line in report.crash_lines():
        parts.append(f"<p class='crash'>{_e(line)}</p>")
    if report.interrupted and not report.findings:
        parts.append(
            f"<p class='crash'>Interrupted after {report.steps_observed} observed step(s): nothing was diagnosed.</p>"
        )
    elif not report.findings:
        clean = report.clean_line
        parts.append(f"<p class='clean'>{clean}</p>")
    if report.compared is not None:
        parts.append(f"<p class='note'>{_e(compared_line(report.compared))}</p>")
    return "".join(parts)


def _usage_caption(report: ReportData) -> str:
    usage = report.usage_map
    assert usage is not None
    from ddp_doctor.report.plots import COLORS

    legend = "".join(
        f"<dt><span class='swatch' style='background:{COLORS[k]}'></span>{_e(STATES[k])}</dt>"
        f"<dd>{_e(STATE_HELP[k])}</dd>"
        for k in STATES
    )
    blocks = (
        "one block of columns per rank"
        if len(usage.patterns) == report.world_size
        else "one block of columns per distinct rank pattern (ranks that saw exactly the same share a block)"
    )
    omitted = (
        f" {len(usage.ranks_omitted)} rank(s) with rarer patterns are not drawn: "
        f"{_e(rank_ranges(usage.ranks_omitted, limit=64))}."
        if usage.ranks_omitted
        else ""
    )
    rows = (
        "Rows are modules (more parameters than fit one row each): a module row shows the most notable state "
        "among its parameters."
        if usage.aggregated
        else "Rows are parameters, grouped by module."
    )
    return (
        f"<figcaption>Usage map over the {usage.steps} step(s) every rank completed: {blocks}. {rows} "
        f"Row labels in colour are named by a finding (red: error, amber: warning, blue: info).{omitted}"
        f"<dl>{legend}</dl></figcaption>"
    )


def _figures(report: ReportData, key: str) -> str:
    from ddp_doctor.report.plots import divergence_svg, usage_map_svg

    if report.usage_map is None and report.divergence is None:
        return (
            "<p class='no-figures'>No usage map or divergence curve: this report has no per-step records to "
            "draw (no step completed on every rank, or the ranks could not exchange their records).</p>"
        )
    out = []
    if report.usage_map is not None:
        severities = {f.code: f.severity for f in reversed(report.findings)}
        out.append(
            f"<figure class='usage-map' id='{key}-usage-map'>{usage_map_svg(report.usage_map, severities)}"
            f"{_usage_caption(report)}</figure>"
        )
    if report.divergence is not None:
        d = report.divergence
        out.append(
            f"<figure class='divergence' id='{key}-divergence'>"
            f"{divergence_svg(d, world_size=report.world_size)}"
            "<figcaption>Divergence curve. Each point is the max over parameters, over ranks r and over both "
            "fingerprint numbers (the sum, and a sum weighted by a fixed pattern) of |fingerprint(rank r) - "
            'fingerprint(rank 0)|: weights after each step ("start": when observing began), gradients as '
            "the optimizer saw them. 0 means bit-identical on every rank; a dashed line marks the first "
            "step where each differs.</figcaption></figure>"
        )
    if report.timing.per_rank and all(t.gpu_clock for t in report.timing.per_rank):
        out.append(f"<p class='timing'>{html.escape(phases_line(report.timing.per_rank))}</p>")
    elif report.timing.per_rank:
        from ddp_doctor.report.plots import shown_ranks, step_time_svg

        per_rank = report.timing.per_rank
        shown = len(shown_ranks(per_rank))
        total = max(report.timing.ranks_measured, len(per_rank))
        which = (
            ""
            if shown == total
            else f" {shown} of the {total} ranks are drawn: the slowest, the fastest and the lowest."
        )
        out.append(
            f"<figure class='step-time' id='{key}-step-time'>{step_time_svg(per_rank)}"
            "<figcaption>Where each rank's step goes, measured on this machine (median over the observed steps, "
            "the first left out): waiting for data (from the end of one step to the next forward, the "
            "DataLoader's __next__ included), forward, backward compute, waiting in DDP's gradient all-reduce "
            f"(from autograd's end to DDP's finalize), optimizer.{which}</figcaption></figure>"
        )
    return "".join(out)


def _recommendation(report: ReportData, key: str) -> str:
    rec = report.recommendation
    verdict = "verified" if rec.verified else "not yet verified"
    flags = (
        f"find_unused_parameters={rec.find_unused_parameters}, static_graph={rec.static_graph}, "
        f"gradient_as_bucket_view={rec.gradient_as_bucket_view}"
    )
    freeze = (
        f"<p>freeze before wrap: {', '.join(f'<code>{_e(n)}</code>' for n in rec.freeze_before_wrap)}</p>"
        if rec.freeze_before_wrap
        else ""
    )
    first = report.framework if report.framework in rec.render else "torch"
    order = [k for k in (first, *FRAMEWORKS) if k in rec.render]
    order = list(dict.fromkeys(order))
    inputs = "".join(
        f"<input type='radio' name='{key}-rec' id='{key}-rec-{k}'{' checked' if i == 0 else ''}>"
        f"<label for='{key}-rec-{k}'>{_e(k)}</label>"
        for i, k in enumerate(order)
    )
    panels = "".join(
        f"<div class='panel' data-framework='{_e(k)}'><button class='copy' type='button'>Copy</button>"
        f"<pre><code>{_e(rec.render[k])}</code></pre></div>"
        for k in order
    )
    tabs = f"<div class='tabs'>{inputs}{panels}</div>" if order else ""
    if not report.ddp_built or not rec.flags_known:
        # No DDP model, or nothing observed supports flags (they are None): only the reason applies.
        return f"<div class='recommendation'><h3>No DDP flags to recommend</h3><p>{_e(recommendation_words(rec, report.framework))}</p></div>"
    return (
        f"<div class='recommendation'><h3>Recommendation ({verdict})</h3><p><b>{_e(flags)}</b></p>{freeze}"
        f"<p>{_e(recommendation_words(rec, report.framework))}</p>{tabs}</div>"
    )


def check_section(report: ReportData, *, key: str = "m0", heading: str | None = None) -> str:
    """The report as an HTML section: header, findings, figures, recommendation, timing.

    Args:
        report: the report to draw.
        key: a prefix for the section's element ids, unique within the page.
        heading: a title above the section (for pages with several models).
    """
    t = report.timing
    timing = (
        f"<p class='timing'>median per step (observed, hooks included): forward {t.forward_s * 1e3:.1f} ms, "
        f"backward {t.backward_s * 1e3:.1f} ms, optimizer {t.optimizer_s * 1e3:.1f} ms</p>"
        if t.step_s is not None and None not in (t.forward_s, t.backward_s, t.optimizer_s)
        else ""
    )
    title = f"<h2>{_e(heading)}</h2>" if heading else ""
    lines = following_lines(report.following) if report.following is not None else []
    following = f"<p class='timing following'>{'<br>'.join(_e(x) for x in lines)}</p>" if lines else ""
    # What the script left behind and what the check did not see: beside the findings, not in the dim lines.
    notes = [
        *(files_lines(report) if report.files_written else []),
        *(f"Not checked: {u.text}" for u in report.unchecked),
    ]
    left = f"<p class='crash'>{'<br>'.join(_e(x) for x in notes)}</p>" if notes else ""
    return (
        f"<section class='ddp-check' id='{key}'>{title}<p class='version'>ddp-doctor {_e(report.tool_version)}"
        f"</p>{_head(report)}{_status(report)}{''.join(_finding(f, c) for f, c in by_cause(report.findings))}{left}"
        f"{_figures(report, key)}{_recommendation(report, key)}{timing}{following}</section>"
    )


@dataclass(kw_only=True, slots=True)
class IndexEntry:
    """One row of an index page (`demo --html`)."""

    name: str
    href: str
    summary: str = ""
    worst: str | None = None
    codes: list[str] = field(default_factory=list)
    error: str | None = None


def index_page(title: str, entries: Sequence[IndexEntry], intro: str = "") -> str:
    """A page linking to one page per entry, with each one's findings at a glance (`demo --html`'s index).

    Args:
        title: the page's title and heading.
        entries: one row each, in order.
        intro: a sentence under the heading (plain text).
    """
    rows = []
    for e in entries:
        if e.error is not None:
            verdict = f"<span class='crash'>{_e(e.error[:300])}</span>"
        else:
            verdict = (
                ", ".join(f"<code>{_e(c)}</code>" for c in e.codes) + f" ({_e(e.worst)})"
                if e.worst
                else "<span class='clean'>none</span>"
            )
        rows.append(
            f"<tr data-example='{_e(e.name)}'><td><a href='{_e(e.href)}'>{_e(e.name)}</a></td>"
            f"<td>{_e(e.summary)}</td><td>{verdict}</td></tr>"
        )
    table = (
        "<table class='index'><thead><tr><th>example</th><th>what it does</th><th>findings</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )
    return page(title, f"<h1>{_e(title)}</h1>{f'<p>{_e(intro)}</p>' if intro else ''}{table}")
