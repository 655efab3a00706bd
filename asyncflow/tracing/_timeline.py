"""A trace as a picture: one lane per rank, one colour per role.

Each rank's part of each call is a bar in its lane ("pool/rank", top to bottom in
the trace's pool order), the pieces of input it pulled are thin darker bars along
the bottom of the lane, failed calls are faded, and each step's start is a dashed
vertical line. The x axis is seconds from the trace's start.

Drawn with a bare :class:`matplotlib.figure.Figure` on the Agg canvas, so that it
neither needs nor changes pyplot's global backend.
"""

from __future__ import annotations

from pathlib import Path

from asyncflow.tracing._analysis import pool_ranks, role_order, time_origin, trace_end
from asyncflow.tracing._records import Trace

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
"""Role colours, in the trace's role order (matplotlib's tab10)."""
MAX_STEP_LABELS = 40
"""More steps than this: step lines without labels."""

_Bars = dict[tuple[int, str, bool], list[tuple[float, float]]]


def write_timeline_png(trace: Trace, path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``trace`` as a timeline and save it as a PNG (parent folders made).

    The figure grows with the number of spans (wider) and of ranks (taller), within
    bounds; a trace without calls gives an empty timeline.

    Args:
        trace: the recorded trace.
        path: where to write the PNG.
        title: the figure's title (default: the number of calls and the time span).

    Returns:
        The path written.
    """
    # matplotlib loads here, not with the package: the runtime's tracer imports
    # asyncflow.tracing in every driver.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    origin = time_origin(trace)
    horizon = max(trace_end(trace) - origin, 1e-3)
    lanes = [(pool, r) for pool, n in pool_ranks(trace).items() for r in range(n)]
    lane_y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    colours = {role: PALETTE[i % len(PALETTE)] for i, role in enumerate(role_order(trace))}
    n_spans = sum(len(c.ranks) for c in trace.calls)

    fig = Figure(figsize=(min(max(8.0, 6.0 + 0.04 * n_spans), 30.0), min(2.0 + 0.4 * max(len(lanes), 1), 30.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bars: _Bars = {}
    pulls: _Bars = {}
    for call in trace.calls:
        for span in call.ranks:
            y = lane_y[(span.pool, span.rank)]
            bars.setdefault((y, call.role, call.ok), []).append((span.start - origin, span.seconds))
            for pull in span.pulls:
                pulls.setdefault((y, call.role, call.ok), []).append((pull.start - origin, pull.end - pull.start))
    for (y, role, ok), ranges in bars.items():
        ax.broken_barh(ranges, (y - 0.4, 0.8), facecolors=colours[role], edgecolor="white", linewidth=0.3,
                       alpha=1.0 if ok else 0.35)
    for (y, role, ok), ranges in pulls.items():
        dark = tuple(0.55 * c for c in to_rgb(colours[role]))
        ax.broken_barh(ranges, (y - 0.4, 0.16), facecolors=[dark], linewidth=0, alpha=1.0 if ok else 0.35)
    for k, t in enumerate(trace.steps):
        ax.axvline(t - origin, color="0.35", linestyle="--", linewidth=0.8)
        if len(trace.steps) <= MAX_STEP_LABELS:
            ax.text(t - origin, 1.0, f" step {k}", transform=ax.get_xaxis_transform(), fontsize=7,
                    ha="left", va="bottom", color="0.35")

    ax.set_yticks([lane_y[lane] for lane in lanes], [f"{pool}/{r}" for pool, r in lanes])
    ax.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
    ax.set_xlim(0.0, horizon)
    ax.set_xlabel("seconds from trace start")
    ax.grid(axis="x", alpha=0.3)
    if not trace.calls:
        ax.text(0.5, 0.5, "no calls", transform=ax.transAxes, ha="center", va="center", color="0.5")
    used = dict.fromkeys(c.role for c in trace.calls)
    handles: list[Patch | Line2D] = [Patch(facecolor=colours[role], label=role) for role in used]
    if any(span.pulls for c in trace.calls for span in c.ranks):
        handles.append(Patch(facecolor="0.3", label="pull"))
    if trace.steps:
        handles.append(Line2D([], [], color="0.35", linestyle="--", linewidth=0.8, label="step start"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title if title is not None else f"{len(trace.calls)} calls over {trace_end(trace) - origin:.3g} s", pad=14)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
    return path
