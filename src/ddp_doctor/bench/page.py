"""`bench --html`: one self-contained page with the table, a step-time chart (matplotlib SVG) and the check report
(the same section `check --html` writes, with its usage map and divergence curve)."""

from __future__ import annotations

import html
import io
from pathlib import Path

from ddp_doctor.bench.run import BenchResult
from ddp_doctor.report import html as report_html

__all__ = ["write_html"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 70em; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.winner { background: #e6f4ea; font-weight: bold; }
tr.incorrect { color: #a00; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
"""


def _chart(result: BenchResult) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [c for c in result.candidates if c.correct and c.steps]
    fig, ax = plt.subplots(figsize=(9, 0.6 * max(len(timed), 1) + 1.5))
    if timed:
        ax.boxplot([[t * 1e3 for t in c.steps] for c in timed], vert=False, showfliers=True)
        ax.set_yticks(range(1, len(timed) + 1), [c.name for c in timed])
        for i, c in enumerate(timed, start=1):
            ax.plot([t * 1e3 for t in c.steps], [i] * len(c.steps), "o", alpha=0.3, markersize=3, color="tab:blue")
    ax.set_xlabel("optimizer step time (ms), unobserved steps of every round")
    ax.set_title("Step-time distribution per correct configuration")
    fig.tight_layout()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    plt.close(fig)
    svg = buffer.getvalue()
    return svg[svg.index("<svg") :]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _table(result: BenchResult) -> str:
    rows = []
    order = sorted(result.candidates, key=lambda c: (not c.correct, c.median_step_s or 0.0))
    for c in order:
        cls = "winner" if c is result.winner else ("incorrect" if not c.correct else "")
        config = ", ".join(f"{k}={v}" for k, v in c.config.to_dict().items() if v not in ((), []))
        cells = [
            f"<td>{html.escape(c.name)}</td>",
            f"<td>{html.escape(config)}</td>",
            f"<td>{'yes' if c.correct else 'no: ' + html.escape(c.reason)}</td>",
            f"<td class='num'>{_fmt(c.median_step_s and c.median_step_s * 1e3, '.2f', ' ms')}</td>",
            f"<td class='num'>{_fmt(c.spread and c.spread * 100, '.0f', '%')}</td>",
            f"<td class='num'>{_fmt(result.ratio_to(c, result.user), '.2f')}</td>",
            f"<td class='num'>{_fmt(result.ratio_to(c, result.winner), '.2f')}</td>",
        ]
        rows.append(f"<tr class='{cls}' data-candidate='{html.escape(c.name)}'>{''.join(cells)}</tr>")
    head = "".join(
        f"<th>{h}</th>" for h in ("candidate", "config", "correct", "median step", "spread (IQR)", "vs user", "vs best")
    )
    return f"<table id='candidates'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def write_html(result: BenchResult, path: Path) -> None:
    """Write the page: verdict, table, chart, the verdict's code per framework, and the check report."""
    rec = result.verdict()
    verdict = html.escape(rec.reason) if rec is not None else "No candidate ran correctly."
    snippets = "".join(f"<h3>{k}</h3><pre>{html.escape(v)}</pre>" for k, v in (rec.render.items() if rec else []))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ddp-doctor bench</title>
<style>{report_html.CSS}{_CSS}</style></head>
<body>
<h1>ddp-doctor bench</h1>
<p id="verdict">{verdict}</p>
{_table(result)}
<p>Each correct candidate's runs: the first steps observed for correctness, then the same number timed with no
hooks. Candidates ran interleaved in rounds. Spread is the interquartile range relative to the median.</p>
<figure id="chart">{_chart(result)}</figure>
<h2>The verdict as code</h2>
{snippets}
<h2>The check report</h2>
{report_html.check_section(result.check, key="check")}
<script>{report_html.SCRIPT}</script>
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
