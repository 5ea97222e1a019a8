"""Compare logged searches: one row per search read back from MLflow, and their Pareto fronts.

:func:`compare_searches` reads the parent runs that :class:`~autoprec.tracking.SearchTracker`
wrote (runs tagged ``autoprec.agent`` without a ``mlflow.parentRunId`` tag, so neither the
nested evaluation runs nor ``autoprec train`` runs count) and returns one plain row per search.
:func:`plot_fronts` draws the Pareto fronts of several searches (each parent's ``pareto.csv``
artifact) into one PNG. MLflow and matplotlib are imported only when called.

Example:
    >>> from autoprec.tracking.compare import compare_searches, plot_fronts, sort_rows
    >>> rows = compare_searches("sqlite:///mlflow.db", model="tinycnn")  # doctest: +SKIP
    >>> rows = sort_rows(rows, "speedup")  # doctest: +SKIP
    >>> plot_fronts(rows, "fronts.png", "sqlite:///mlflow.db")  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec._sqlite import sqlite_file
from autoprec.tracking.client import (
    CALL_LIMITS,
    CONNECT_LIMITS,
    mlflow_limits,
    one_line,
    resolve_tracking_uri,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = [
    "COLUMNS",
    "CompareError",
    "UnknownExperimentError",
    "compare_searches",
    "plot_fronts",
    "sort_rows",
]

# Row key -> (parent run metric, or None for what comes from params/tags/info).
_METRICS = {
    "best_reward": "best_reward",
    "accuracy_delta": "best_accuracy_delta",
    "loss_delta": "best_loss_delta",
    "speedup": "best_speedup",
    "memory_ratio": "best_memory_ratio",
    "evaluations": "evaluations",
    "wall_time_s": "search_wall_time_s",
}
COLUMNS = (
    "run_id",
    "experiment",
    "run_name",
    "model",
    "dataset",
    "agent",
    "target",
    "budget",
    "seed",
    *_METRICS,
    "start_time",
    "status",
)
# "Best first" direction of each column: True sorts descending.
_DESCENDING = {
    "best_reward": True,
    "accuracy_delta": True,
    "speedup": True,
    "evaluations": True,
    "budget": True,
    "start_time": True,  # newest first
}
_PARENT_ONLY = "tags.`mlflow.parentRunId` IS NULL"
_PAGE = 1000


class CompareError(ValueError):
    """Searches cannot be read back as asked (unreachable store, bad sort column, ...)."""


class UnknownExperimentError(CompareError):
    """The experiment asked for does not exist; ``known`` lists the autoprec experiments."""

    def __init__(self, message: str, known: Sequence[str]) -> None:
        super().__init__(message)
        self.known = list(known)


def compare_searches(
    tracking_uri: str | None = None,
    experiment: str | None = None,
    model: str | None = None,
) -> list[dict[str, Any]]:
    """One row per logged search (its parent run), in no particular order.

    Args:
        tracking_uri: MLflow tracking URI; default ``$MLFLOW_TRACKING_URI``, else
            ``sqlite:///mlflow.db``. A SQLite file that does not exist is not created.
        experiment: read only this experiment. Default: ``autoprec/<model>`` when ``model``
            is given, else every ``autoprec/*`` experiment.
        model: keep only searches of this model (with ``experiment`` too).

    Returns:
        Dicts with the keys of :data:`COLUMNS`: ids and settings as strings (``budget`` and
        ``seed`` as ints), metrics as floats, None where the run lacks one (a search that is
        still running or was interrupted before its end), ``start_time`` as ISO 8601 (UTC, to
        the millisecond, so that searches started within one second still sort in order).

    Raises:
        UnknownExperimentError: ``experiment`` was given and does not exist.
        CompareError: the tracking store cannot be read; the message is one line.
    """
    uri = resolve_tracking_uri(tracking_uri)
    missing = _missing_sqlite(uri)
    if missing is not None:
        if experiment is not None:
            raise UnknownExperimentError(
                f"unknown experiment {experiment!r}: there is no MLflow database at {missing}",
                [],
            )
        return []
    try:
        with mlflow_limits(CONNECT_LIMITS):
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            experiments = _experiments(client, experiment, model)
            rows = []
            for exp in experiments:
                for run in _parent_runs(client, exp.experiment_id):
                    row = _row(run, exp.name)
                    if row is not None and (model is None or row["model"] == model):
                        rows.append(row)
    except CompareError:
        raise
    except Exception as err:  # noqa: BLE001 - any store failure is one line for the user
        raise CompareError(f"cannot read searches from {uri}: {one_line(err)}") from None
    return rows


def sort_rows(rows: Iterable[dict[str, Any]], column: str = "best_reward") -> list[dict[str, Any]]:
    """``rows`` sorted by ``column``, best first; missing values last.

    Best first means descending for reward, speedup, accuracy delta, evaluations and budget,
    newest first for ``start_time``, ascending for the rest (loss delta, memory ratio, wall
    time, text). A ``:asc`` or ``:desc`` suffix chooses the direction (``"speedup:asc"``).
    Dashes count as underscores (``"loss-delta"``). Rows that tie keep a fixed order: the
    newest search first, then by run id.

    Raises:
        CompareError: an unknown column or direction.
    """
    name, _, direction = column.partition(":")
    name = name.strip().replace("-", "_")
    if name not in COLUMNS:
        raise CompareError(f"unknown sort column {column!r}; expected one of {', '.join(COLUMNS)}")
    if direction not in ("", "asc", "desc"):
        raise CompareError(f"unknown sort direction {direction!r} in {column!r}; use :asc or :desc")
    descending = _DESCENDING.get(name, False) if not direction else direction == "desc"
    # ties (and the rows that lack the value) keep a fixed order: newest first, then run id
    ordered = sorted(rows, key=lambda r: str(r.get("run_id") or ""))
    ordered.sort(key=lambda r: str(r.get("start_time") or ""), reverse=True)  # stable
    present = [r for r in ordered if _sortable(r.get(name))]
    absent = [r for r in ordered if not _sortable(r.get(name))]
    present.sort(key=lambda r: r[name], reverse=descending)
    return present + absent


def plot_fronts(
    rows: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    tracking_uri: str | None = None,
) -> list[str]:
    """One PNG with the Pareto front of every search in ``rows``, written atomically.

    Each front comes from its parent run's ``pareto.csv`` artifact: speedup over fp32 on x,
    loss delta on y, one colour and marker per search, labelled ``agent/target run-id``.

    Args:
        rows: rows of :func:`compare_searches`.
        path: the PNG to write.
        tracking_uri: where the runs are (as for :func:`compare_searches`).

    Returns:
        The run ids whose front was drawn (searches without a ``pareto.csv``, e.g. interrupted
        ones, are left out).

    Raises:
        CompareError: the artifacts cannot be read.
    """
    uri = resolve_tracking_uri(tracking_uri)
    fronts: list[tuple[dict[str, Any], list[tuple[float, float]]]] = []
    try:
        limits = {**CALL_LIMITS, "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": False}
        with mlflow_limits(limits), tempfile.TemporaryDirectory(prefix="autoprec-") as tmp:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            for i, row in enumerate(rows):
                names = {f.path for f in client.list_artifacts(row["run_id"])}
                if "pareto.csv" not in names:
                    continue
                folder = Path(tmp, str(i))
                folder.mkdir()
                local = client.download_artifacts(row["run_id"], "pareto.csv", str(folder))
                fronts.append((row, _front_points(Path(local))))
    except Exception as err:  # noqa: BLE001 - any store failure is one line for the user
        raise CompareError(f"cannot read Pareto fronts from {uri}: {one_line(err)}") from None

    from autoprec.cache import write_output

    figure = _fronts_figure(fronts)
    write_output(path, lambda fh: figure.savefig(fh, format="png"), binary=True, what="plot")
    return [row["run_id"] for row, _ in fronts]


# -- reading --------------------------------------------------------------------------------
def _missing_sqlite(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI when it does not exist (MLflow would create
    an empty one), else None."""
    file = sqlite_file(uri)
    return None if file is None or file.exists() else file


def _experiments(client: MlflowClient, experiment: str | None, model: str | None) -> list[Any]:
    if experiment is None and model is not None:
        found = client.get_experiment_by_name(f"autoprec/{model}")
        return [found] if found is not None and found.lifecycle_stage == "active" else []
    if experiment is None:
        return _autoprec_experiments(client)
    found = client.get_experiment_by_name(experiment)
    if found is None or found.lifecycle_stage != "active":
        known = [e.name for e in _autoprec_experiments(client)]
        listed = ", ".join(known) if known else "none yet"
        state = "is deleted" if found is not None else "does not exist"
        raise UnknownExperimentError(
            f"experiment {experiment!r} {state}; known autoprec experiments: {listed}", known
        )
    return [found]


def _autoprec_experiments(client: MlflowClient) -> list[Any]:
    found = client.search_experiments(filter_string="name LIKE 'autoprec/%'")
    return sorted(found, key=lambda e: e.name)


def _parent_runs(client: MlflowClient, experiment_id: str) -> Iterable[Any]:
    token = None
    while True:
        page = client.search_runs(
            [experiment_id], filter_string=_PARENT_ONLY, max_results=_PAGE, page_token=token
        )
        yield from page
        token = page.token
        if not token:
            return


def _row(run: Run, experiment: str) -> dict[str, Any] | None:
    """The row of a search's parent run; None for runs that are not searches."""
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    if "autoprec.agent" not in tags or tags.get("autoprec.kind", "search") != "search":
        return None
    info = run.info
    row: dict[str, Any] = {
        "run_id": info.run_id,
        "experiment": experiment,
        "run_name": info.run_name or "",
        "model": params.get("model") or tags.get("autoprec.model", ""),
        "dataset": params.get("dataset", ""),
        "agent": params.get("agent") or tags.get("autoprec.agent", ""),
        "target": params.get("target") or tags.get("autoprec.target", ""),
        "budget": _int(params.get("budget")),
        "seed": _int(params.get("seed")),
    }
    for key, metric in _METRICS.items():
        value = metrics.get(metric)
        row[key] = None if value is None else float(value)
    if row["evaluations"] is not None:
        row["evaluations"] = int(row["evaluations"])
    start = info.start_time
    row["start_time"] = (
        datetime.fromtimestamp(start / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")
        if start
        else None
    )
    row["status"] = info.status
    return row


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _sortable(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


# -- plotting -------------------------------------------------------------------------------
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")


def _front_points(path: Path) -> list[tuple[float, float]]:
    points = []
    with path.open(newline="") as fh:
        for record in csv.DictReader(fh):
            try:
                x, y = float(record["speedup"]), float(record["loss_delta"])
            except (KeyError, TypeError, ValueError):
                continue
            if math.isfinite(x) and math.isfinite(y):
                points.append((x, y))
    return sorted(points)


def _fronts_figure(fronts: Sequence[tuple[dict[str, Any], list[tuple[float, float]]]]) -> Any:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    from autoprec.tracking.plots import mark_fp32

    fig = Figure(figsize=(8, 5.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    colours = colormaps["tab10"].colors
    for i, (row, points) in enumerate(fronts):
        label = f"{row['agent'] or '?'}/{row['target'] or '?'} {row['run_id'][:8]}"
        if not points:
            label += " (empty front)"
            ax.plot([], [], marker=_MARKERS[i % len(_MARKERS)], label=label)
            continue
        xs, ys = zip(*points, strict=True)
        ax.plot(
            xs,
            ys,
            marker=_MARKERS[i % len(_MARKERS)],
            color=colours[i % len(colours)],
            linestyle="-" if len(points) > 1 else "none",
            linewidth=1,
            markersize=7,
            alpha=0.85,
            label=label,
        )
    mark_fp32(ax)
    models = sorted({str(row.get("model") or "?") for row, _ in fronts})
    ax.set_title(f"Pareto fronts of {len(fronts)} searches ({', '.join(models) or 'none'})")
    ax.grid(alpha=0.3)
    if fronts:
        ax.legend(loc="best", fontsize=8)
    return fig
