"""The report's two figures as inline SVG, drawn with matplotlib (the stack `bench --html` uses).

Text stays text in the SVG (`svg.fonttype: none`), so parameter names can be searched and copied in the page, and
the output is deterministic (fixed hash salt, no date), so the same report gives the same page.
"""

from __future__ import annotations

import io
import math
from typing import Any

from ddp_doctor.core.figures import NOTABLE, STATES, Divergence, UsageMap
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.steptime import PHASE_LABELS, PHASES, RankTiming

__all__ = ["COLORS", "MAX_BARS", "PHASE_COLORS", "divergence_svg", "shown_ranks", "step_time_svg", "usage_map_svg"]

COLORS: dict[str, str] = {
    "U": "#2e7d32",  # used: green
    "N": "#d9d9d9",  # no gradient: light grey
    "B": "#ef6c00",  # blocked: orange
    "F": "#5c7fa3",  # frozen: steel blue
    "X": "#c2185b",  # flipped: magenta
    "I": "#f7f7f7",  # ignored by DDP: near white
}
PHASE_COLORS: dict[str, str] = {
    "data_wait_s": "#ef6c00",  # waiting for data: orange
    "forward_s": "#1f4e9c",  # forward: blue
    "backward_s": "#5c7fa3",  # backward compute: steel blue
    "comm_wait_s": "#c2185b",  # waiting in the all-reduce: magenta
    "optimizer_s": "#2e7d32",  # optimizer: green
}
MAX_BARS = 48
"""Ranks drawn at most in the step-time figure (the slowest, then the fastest, then the lowest ranks)."""
_SEVERITY_COLOR = {"error": "#b00020", "warning": "#a15c00", "info": "#00639b"}
_RC = {"svg.fonttype": "none", "svg.hashsalt": "ddp-doctor", "font.size": 9}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any) -> str:
    plt = _pyplot()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    svg = buffer.getvalue()
    return svg[svg.index("<svg") :]


def usage_map_svg(usage: UsageMap, severities: dict[str, str] | None = None) -> str:
    """Rows (parameters, or modules when aggregated) against steps, one block of columns per distinct rank pattern.

    Args:
        usage: the report's usage map.
        severities: finding code -> severity; rows named by a finding get their label coloured by the worst.
    """
    plt = _pyplot()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    keys = list(STATES)
    rows, steps, blocks = usage.rows, usage.steps, usage.patterns
    severities = severities or {}
    label_chars = max(len(r.name) for r in rows)
    block_w = max(1.3, 0.3 * steps)
    width = min(2.0 + 0.065 * label_chars + len(blocks) * (block_w + 0.25), 60.0)
    height = 1.9 + 0.2 * len(rows)
    with plt.rc_context(_RC):
        fig, axes = plt.subplots(
            1, len(blocks), sharey=True, squeeze=False, figsize=(width, height), layout="constrained"
        )
        fig.get_layout_engine().set(w_pad=0.15, h_pad=0.1)
        cmap = ListedColormap([COLORS[k] for k in keys])
        norm = BoundaryNorm([i - 0.5 for i in range(len(keys) + 1)], cmap.N)
        module_edges = [i for i in range(1, len(rows)) if rows[i].module != rows[i - 1].module]
        for ax, pattern in zip(axes[0], blocks):
            grid = [[keys.index(c) for c in cells] for cells in pattern.cells]
            ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
            ax.set_xticks(range(steps), [str(s) for s in range(steps)])
            ax.set_xticks([s - 0.5 for s in range(1, steps)], minor=True)
            if len(rows) <= 64:  # cell borders help to read a few rows; on hundreds they only cost
                ax.set_yticks([r - 0.5 for r in range(1, len(rows))], minor=True)
            ax.grid(which="minor", color="white", linewidth=0.8)
            ax.tick_params(which="minor", length=0)
            for edge in module_edges:
                ax.axhline(edge - 0.5, color="#333333", linewidth=1.0)
            ax.set_xlabel("step")
            ax.set_title(rank_list(pattern.ranks), fontsize=9)
        first = axes[0][0]
        first.set_yticks(range(len(rows)), [r.name + (f" ({r.params} params)" if r.params > 1 else "") for r in rows])
        for label, row in zip(first.get_yticklabels(), rows):
            worst = next(
                (s for s in ("error", "warning", "info") if any(severities.get(c) == s for c in row.codes)), None
            )
            if worst is not None:
                label.set_color(_SEVERITY_COLOR[worst])
                label.set_fontweight("bold")
        present = {c for p in blocks for cells in p.cells for c in cells}
        handles = [Patch(facecolor=COLORS[k], edgecolor="#999999", label=STATES[k]) for k in keys if k in present]
        title = "Which parameter got a gradient, per step and rank"
        if usage.aggregated:
            title += f"\n(one row per module: the most notable state among its parameters, in the order {NOTABLE})"
        fig.suptitle(title, fontsize=10)
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
        return _svg(fig)


def divergence_svg(div: Divergence, *, world_size: int) -> str:
    """Weights (after each step) and gradients (at each optimizer step): largest cross-rank difference, log scale."""
    plt = _pyplot()
    measure = "max over parameters and ranks r of\n|fingerprint(rank r) - fingerprint(rank 0)|"
    w_x = list(range(-1, div.steps))
    g_x = list(range(div.steps))
    finite = [v for v in (*div.weights, *div.grads) if v > 0 and math.isfinite(v)]
    floor = min(finite) / 30 if finite else 1e-12
    top = max(finite) * 30 if finite else 1.0
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(9, 3.8), layout="constrained")
        for xs, values, label, color, marker in (
            (w_x, div.weights, "weights after the step", "#1f4e9c", "o"),
            (g_x, div.grads, "gradients at the optimizer step", "#c2185b", "s"),
        ):
            shown = [min(v, top) if v > 0 else floor for v in values]
            ax.plot(xs, shown, color=color, marker=marker, label=label, linewidth=1.5)
            zero = [(x, floor) for x, v in zip(xs, values) if v == 0]
            if zero:
                ax.plot(*zip(*zero), linestyle="none", marker=marker, markerfacecolor="white", color=color)
        missing = [x for x, m in zip(g_x, div.grads_missing) if m]
        if missing:
            ax.plot(
                missing,
                [top] * len(missing),
                linestyle="none",
                marker="v",
                color="#ef6c00",
                label="a gradient present on some ranks only",
            )
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, top * 2)
        if not finite:
            # Nothing differs: a log axis of made-up decades would mislead; one tick, "0".
            ax.set_yticks([floor], ["0"])
            ax.minorticks_off()
        ax.axhline(floor, color="#999999", linewidth=0.8, linestyle=":")
        ax.annotate(
            "identical on every rank (0)",
            xy=(1.0, floor),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 3),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color="#666666",
        )
        for start, label, color in (
            (div.weights_start, "weights differ", "#1f4e9c"),
            (div.grads_start, "gradients differ", "#c2185b"),
        ):
            if start is None:
                continue
            ax.axvline(start, color=color, linestyle="--", linewidth=1)
            if label == "weights differ":
                where = "already at the start" if start < 0 else f"after step {start}"
            else:
                where = f"in step {start}"
            ax.annotate(
                f"{label} {where}",
                (start, top),
                xytext=(4, -12 if label == "weights differ" else -26),
                textcoords="offset points",
                color=color,
                fontsize=8,
            )
        ax.set_xticks(w_x, ["start"] + [str(s) for s in g_x])
        ax.set_xlabel("step")
        ax.set_ylabel(measure, fontsize=8)
        if world_size < 2:
            title = "Cross-rank difference per step (one rank: nothing to compare)"
        elif div.weights_start is None and div.grads_start is None:
            title = "Cross-rank difference per step: weights and gradients identical on every rank"
        else:
            title = "Cross-rank difference per step (log scale)"
        ax.set_title(title, fontsize=10)
        ax.legend(loc="center left", fontsize=8, frameon=False)
        return _svg(fig)


def shown_ranks(per_rank: list[RankTiming]) -> list[RankTiming]:
    """The ranks the step-time figure draws, in rank order: every rank up to `MAX_BARS`, else the slowest and the
    fastest by own time (the ones a straggler finding compares) and the lowest ranks."""
    if len(per_rank) <= MAX_BARS:
        return list(per_rank)
    by_own = sorted(per_rank, key=lambda t: t.own_s)
    keep = {t.rank for t in by_own[-MAX_BARS // 4 :] + by_own[: MAX_BARS // 4]}
    keep.update(t.rank for t in per_rank[: MAX_BARS - len(keep)])
    return [t for t in per_rank if t.rank in keep]


def step_time_svg(per_rank: list[RankTiming]) -> str:
    """One horizontal bar per rank: the median of each phase (`PHASES`), stacked, and the median step with its
    interquartile range written beside it."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    shown = shown_ranks(per_rank)
    height = 1.4 + 0.28 * len(shown)
    with plt.rc_context(_RC):
        fig, ax = plt.subplots(figsize=(7.5, height), layout="constrained")
        ys = list(range(len(shown)))
        left = [0.0] * len(shown)
        for phase in PHASES:
            widths = [t.median[phase] * 1e3 for t in shown]
            ax.barh(ys, widths, left=left, color=PHASE_COLORS[phase], height=0.7)
            left = [a + b for a, b in zip(left, widths)]
        # The median step is not the sum of the phases' medians: it is written beside the bar, with its spread.
        for y, t, end in zip(ys, shown, left):
            ax.annotate(
                f"step {t.median['step_s'] * 1e3:.1f} ms (IQR {t.iqr['step_s'] * 1e3:.1f})",
                (end, y),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                color="#333333",
            )
        ax.set_xlim(0, max(left) * 1.35 if max(left) > 0 else 1)
        ax.set_yticks(ys, [f"rank {t.rank}" for t in shown])
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median of each phase over the observed steps)")
        ax.set_title("Where each rank's step goes", fontsize=10)
        handles = [Patch(color=PHASE_COLORS[p], label=PHASE_LABELS[p]) for p in PHASES]
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.35 if len(shown) < 4 else -0.15),
            ncol=3,
            fontsize=8,
            frameon=False,
        )
        return _svg(fig)
