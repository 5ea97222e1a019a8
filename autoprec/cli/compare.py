"""``autoprec compare``: the logged searches side by side, as a table, CSV and a Pareto chart.

Example::

    autoprec compare --model tinycnn
    autoprec compare --experiment autoprec/resnet18 --sort speedup --csv runs.csv --plot fronts.png
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from autoprec.cli.mlflow_options import tracking_uri_option

# (row key, header, format) of the table's columns.
_TABLE = (
    ("run_id", "run", lambda v: str(v)[:8]),
    ("agent", "agent", str),
    ("target", "target", str),
    ("budget", "budget", str),
    ("evaluations", "evals", str),
    ("best_reward", "best reward", lambda v: f"{v:.3f}"),
    ("speedup", "speedup", lambda v: f"{v:.2f}x"),
    ("memory_ratio", "memory", lambda v: f"{v:.2f}x"),
    ("loss_delta", "loss Δ", lambda v: f"{v:+.4f}"),
    ("accuracy_delta", "acc Δ", lambda v: f"{v:+.4f}"),
    ("wall_time_s", "wall time", lambda v: f"{v:.0f} s"),
    ("start_time", "started (UTC)", lambda v: str(v).replace("T", " ").split("+")[0]),
    ("status", "status", str),
)


@click.command()
@click.option(
    "--experiment", default=None, help="MLflow experiment (default: every autoprec/* one)."
)
@click.option(
    "--model", "model_name", default=None, help="Only searches of this model (autoprec/MODEL)."
)
@tracking_uri_option
@click.option(
    "--sort",
    "sort_by",
    default="best_reward",
    show_default=True,
    help="Column to sort by, best first (e.g. speedup, loss_delta, start_time); add :asc or "
    ":desc to choose the direction.",
)
@click.option(
    "--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Write the rows."
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a PNG with every search's Pareto front.",
)
def compare(
    experiment: str | None,
    model_name: str | None,
    tracking_uri: str | None,
    sort_by: str,
    csv_path: str | None,
    plot_path: str | None,
) -> None:
    """Compare the searches logged to MLflow: one row per search."""
    from autoprec.cache import csv_text, write_output
    from autoprec.cli._setup import check_writable
    from autoprec.tracking import resolve_tracking_uri
    from autoprec.tracking.compare import (
        COLUMNS,
        CompareError,
        compare_searches,
        plot_fronts,
        sort_rows,
    )

    # CompareError (a ValueError) becomes one line and exit status 2 in autoprec.cli.main
    for option, path in (("--csv", csv_path), ("--plot", plot_path)):
        if path is not None:  # before reading the store
            check_writable([Path(path).absolute().parent], CompareError, f"{option} {path}: ")
    rows = sort_rows(compare_searches(tracking_uri, experiment, model_name), sort_by)
    if not rows:
        where = experiment or (f"autoprec/{model_name}" if model_name else "autoprec/*")
        also = f" of model {model_name!r}" if model_name and experiment else ""
        uri = resolve_tracking_uri(tracking_uri)
        click.echo(f"no autoprec searches{also} in experiment {where} at {uri}")
        return
    _print_table(rows)
    if csv_path is not None:
        text = csv_text(rows, COLUMNS)
        written = write_output(csv_path, lambda fh: fh.write(text), what="CSV")
        click.echo(f"{len(rows)} rows -> {written}")
    if plot_path is not None:
        drawn = plot_fronts(rows, plot_path, tracking_uri)
        left = len(rows) - len(drawn)
        note = f" ({left} without pareto.csv left out)" if left else ""
        click.echo(f"{len(drawn)} Pareto fronts -> {plot_path}{note}")


def _print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    experiments = sorted({row["experiment"] for row in rows})
    title = f"{len(rows)} searches in {', '.join(experiments)}"
    table = Table(title=title, title_justify="left")
    columns = list(_TABLE)
    if len(experiments) > 1:
        columns.insert(1, ("experiment", "experiment", str))
    for key, header, _ in columns:
        numeric = key not in ("run_id", "experiment", "agent", "target", "start_time", "status")
        table.add_column(header, justify="right" if numeric else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(_cell(row.get(key), fmt) for key, _, fmt in columns))
    console = Console(markup=False)  # names are data: an experiment "a[b]" stays whole
    if not console.is_terminal:  # a pipe or a file: no squeezed columns
        console = Console(width=max(console.width, 200), markup=False)
    console.print(table)


def _cell(value: object, fmt: Callable[[object], str]) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt(value)
