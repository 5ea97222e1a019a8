"""The click options of the subcommands that log to or read from MLflow (search, train,
compare), written once so that their names, defaults and help stay the same everywhere."""

from __future__ import annotations

from typing import Any

import click

from autoprec.tracking.client import DEFAULT_TRACKING_URI

#: ``--tracking-uri``: None lets :func:`autoprec.tracking.resolve_tracking_uri` choose.
tracking_uri_option = click.option(
    "--tracking-uri",
    default=None,
    help=f"MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else {DEFAULT_TRACKING_URI} here).",
)
#: ``--experiment`` of the commands that log runs.
experiment_option = click.option(
    "--experiment", default=None, help="MLflow experiment name (default: autoprec/<model>)."
)


def no_mlflow_option(what: str) -> Any:
    """``--no-mlflow`` of ``train`` and ``verify`` (also ``AUTOPREC_NO_MLFLOW=1``)."""
    return click.option(
        "--no-mlflow",
        is_flag=True,
        envvar="AUTOPREC_NO_MLFLOW",
        help=f"Do not log {what} to MLflow (also AUTOPREC_NO_MLFLOW=1).",
    )
