"""MLflow tracking: searches (:class:`SearchTracker`), trainings (:class:`TrainTracker`),
verifications (:class:`VerifyTracker`) and the one guarded client they use
(:mod:`autoprec.tracking.client`).

MLflow and matplotlib are imported only when tracking starts, so importing this package is
cheap.

Example:
    >>> from autoprec.tracking import SearchRunInfo, SearchTracker
    >>> SearchTracker(SearchRunInfo("tinycnn"), enabled=False).start()
    False
"""

from __future__ import annotations

from autoprec._sqlite import sqlite_file, sqlite_lock
from autoprec.tracking.client import (
    CALL_LIMITS,
    CONNECT_LIMITS,
    DEFAULT_TRACKING_URI,
    EXPERIMENT_TAGS,
    STATUSES,
    GuardedClient,
    experiment_id,
    mlflow_limits,
    one_line,
    resolve_tracking_uri,
)
from autoprec.tracking.search import SearchRunInfo, SearchTracker, lowered_layers, policy_digest
from autoprec.tracking.training import TrainTracker
from autoprec.tracking.verification import VerifyTracker

__all__ = [
    "CALL_LIMITS",
    "CONNECT_LIMITS",
    "DEFAULT_TRACKING_URI",
    "EXPERIMENT_TAGS",
    "STATUSES",
    "GuardedClient",
    "SearchRunInfo",
    "SearchTracker",
    "TrainTracker",
    "VerifyTracker",
    "experiment_id",
    "lowered_layers",
    "mlflow_limits",
    "one_line",
    "policy_digest",
    "resolve_tracking_uri",
    "sqlite_file",
    "sqlite_lock",
]
