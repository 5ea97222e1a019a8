"""The figures: a search's Pareto chart, the precision map of a policy, a verification's learning
curves; saved as PNG.

matplotlib is imported only when a figure is drawn; the figures are plain
:class:`matplotlib.figure.Figure` objects (no pyplot state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from autoprec.agents.result import SearchResult
    from autoprec.evaluate import Metrics

#: The colour of each precision in the figures.
COLOURS = {
    "fp32": "#4c72b0",
    "tf32": "#64b5cd",
    "bf16": "#55a868",
    "fp16": "#dd8452",
    "fp8": "#c44e52",
}


def mark_fp32(ax: Any) -> None:
    """The fp32 reference point (speedup 1, loss delta 0) and the axes' labels."""
    ax.scatter([1.0], [0.0], marker="X", s=90, c="black", zorder=5)
    ax.annotate("fp32", (1.0, 0.0), textcoords="offset points", xytext=(6, 6))
    ax.set_xlabel("speedup over fp32 (x)")
    ax.set_ylabel("loss delta (relative to fp32)")


def pareto_figure(
    result: SearchResult, amp: Metrics | None, tolerance: float, title: str
) -> Figure:
    """Every real evaluation's speedup and loss delta, the Pareto front, the best policy, and
    the fp32 and AMP references under the accuracy tolerance's line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    points = [
        (t.metrics.speedup, t.metrics.loss_delta)
        for t in result.real_trials
        if math.isfinite(t.metrics.speedup) and math.isfinite(t.metrics.loss_delta)
    ]
    if points:
        ax.scatter(*zip(*points, strict=True), c="0.65", s=22, label="evaluated policies")
    front = sorted(result.pareto, key=lambda t: t.metrics.speedup)
    if front:
        xs = [t.metrics.speedup for t in front]
        ys = [t.metrics.loss_delta for t in front]
        ax.scatter(xs, ys, c="#c44e52", s=40, zorder=3, label="Pareto front")
    best = result.best
    if best is not None and math.isfinite(best.metrics.loss_delta):
        ax.scatter(
            [best.metrics.speedup],
            [best.metrics.loss_delta],
            marker="*",
            s=220,
            c="#dd8452",
            edgecolors="black",
            zorder=4,
            label=f"best (reward {best.reward:.3f})",
        )
    mark_fp32(ax)
    if amp is not None and math.isfinite(amp.speedup) and math.isfinite(amp.loss_delta):
        ax.scatter([amp.speedup], [amp.loss_delta], marker="X", s=90, c="black", zorder=5)
        ax.annotate("AMP", (amp.speedup, amp.loss_delta), textcoords="offset points", xytext=(6, 6))
    ax.axhline(tolerance, color="0.4", linestyle="--", linewidth=0.8)
    ax.annotate(
        "accuracy tolerance",
        (0.01, tolerance),
        xycoords=("axes fraction", "data"),
        textcoords="offset points",
        xytext=(0, 3),
        fontsize=8,
        color="0.4",
    )
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def precision_map(policy: Mapping[str, Any], title: str) -> Any:
    """Bar per layer in execution order: length the format's bits, colour its precision."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from autoprec.precision import parse_precision

    names = [str(k) for k in policy]
    values, widths = [], []
    for value in policy.values():
        try:
            precision = parse_precision(value)
        except ValueError:
            values.append(str(value))
            widths.append(32)
        else:
            values.append(precision.value)
            widths.append(precision.bits)
    n = len(names)
    fig = Figure(figsize=(7, min(max(2.5, 0.25 * n + 1.2), 60)), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ys = list(range(n))
    ax.barh(ys, widths, color=[COLOURS.get(v, "0.6") for v in values], edgecolor="white")
    ax.set_yticks(ys, names if n <= 200 else [""] * n, fontsize=8 if n <= 60 else 5)
    ax.invert_yaxis()  # execution order from the top
    ax.set_xlabel("bits per value of the layer's matrix work (operands)")
    ax.set_xticks([0, 8, 16, 19, 32])
    ax.set_title(title, fontsize=10)
    present = list(dict.fromkeys(values))
    handles = [Patch(color=COLOURS.get(v, "0.6"), label=v) for v in present]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="precision"
    )
    return fig


def curves_figure(result: Any, title: str) -> Any:
    """A verification's learning curves: per arm the mean training loss over the seeds at each
    step, in a band from the lowest to the highest seed (a ``VerifyResult``)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for arm in result.arms:
        # a diverged run's curve stops where it diverged: each step averages the runs that
        # reached it with a finite loss (none: a gap)
        length = max(len(run.curve) for run in arm.runs)
        columns = [
            [r.curve[i] for r in arm.runs if i < len(r.curve) and math.isfinite(r.curve[i])]
            for i in range(length)
        ]
        columns = [c or [math.nan] for c in columns]
        steps = list(range(1, length + 1))
        mean = [sum(c) / len(c) for c in columns]
        label = f"{arm.label} ({len(arm.runs)} seeds"
        label += f", {arm.diverged} diverged)" if arm.diverged else ")"
        (line,) = ax.plot(steps, mean, linewidth=1.2, label=label)
        if len(arm.runs) > 1:
            low, high = [min(c) for c in columns], [max(c) for c in columns]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def save_png(path: Path, figure: Any) -> Path:
    """Write ``figure`` to ``path`` as PNG (:func:`autoprec.cache.write_output`), readable by
    all; returns the path.

    Raises:
        autoprec.cache.OutputError: it cannot be written (then it is kept in the cache's
            recovered folder, and the message says where).
    """
    from autoprec.cache import write_output

    write_output(path, lambda fh: figure.savefig(fh, format="png"), binary=True, what="plot")
    path.chmod(0o644)  # an artifact is read by the whole store's users, whatever our umask
    return path
