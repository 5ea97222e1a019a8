"""One guarded MLflow client: the tracking URI, HTTP limits, the SQLite lock, one-line errors.

Everything autoprec sends to MLflow (the search and training trackers, ``autoprec compare``)
goes through this module:

* :func:`resolve_tracking_uri` is the one reading of ``--tracking-uri``,
  ``$MLFLOW_TRACKING_URI`` and :data:`DEFAULT_TRACKING_URI`;
* :func:`mlflow_limits` gives MLflow's HTTP retries and timeouts for autoprec's own calls
  (:data:`CONNECT_LIMITS` for the first contact, :data:`CALL_LIMITS` after it) without
  changing them for the rest of the process;
* :class:`GuardedClient` runs the trackers' calls so that a failure turns tracking off with one
  line on stderr (``autoprec: tracking off: <reason>``) instead of ending the work.

Every run autoprec creates is tagged with the process that owns it (:data:`PID_TAG`,
:data:`HOST_TAG`). A run that process could not end (SIGKILL, a power cut) would stay
``RUNNING`` forever; whenever a process opens the experiment again, the runs left ``RUNNING`` by
a process of this host that is gone are ended as ``KILLED`` (:func:`end_stale_runs`).

MLflow is imported only when a store is opened.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from autoprec._sqlite import sqlite_lock

if TYPE_CHECKING:
    from mlflow import MlflowClient

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
STATUSES = ("FINISHED", "KILLED", "FAILED")
PID_TAG = "autoprec.pid"  # the process that created a run, and its host
HOST_TAG = "autoprec.host"
EXPERIMENT_TAGS = {
    # MLflow 3's UI opens an experiment of this kind on its "Model training" runs table
    "mlflow.experimentKind": "custom_model_development",
}
# HTTP limits for autoprec's own calls, where the user has not set them: the first contact
# fails fast (an unreachable server costs a moment, not MLflow's minutes of retries); later
# calls retry a little, so one hiccup does not end tracking.
CONNECT_LIMITS: Mapping[str, Any] = MappingProxyType(
    {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": 0, "MLFLOW_HTTP_REQUEST_TIMEOUT": 5}
)
CALL_LIMITS: Mapping[str, Any] = MappingProxyType(
    {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": 2,
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1,
        "MLFLOW_HTTP_REQUEST_TIMEOUT": 30,
    }
)
#: MLflow settings :func:`mlflow_limits` can scope (typed values, as MLflow reads them).
SCOPED_SETTINGS = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
)
_SCOPED: ContextVar[Mapping[str, Any]] = ContextVar(
    "autoprec_mlflow_limits", default=MappingProxyType({})
)


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else :data:`DEFAULT_TRACKING_URI`."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def one_line(err: BaseException) -> str:
    """``err`` as one short line; for a connection failure, just its cause."""
    text = " ".join(str(err).split()) or type(err).__name__
    refused = re.search(r"\[Errno -?\d+\][^'\")\]]*", text)
    if refused:
        return f"cannot connect: {refused.group(0).strip()}"
    if "timed out" in text.lower():
        return "cannot connect: timed out"
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(err).__name__}: {text}"


@contextlib.contextmanager
def mlflow_limits(limits: Mapping[str, Any]) -> Iterator[None]:
    """Let MLflow calls made in this block (this thread or task) use ``limits``.

    ``limits`` maps names of :data:`SCOPED_SETTINGS` to typed values; a variable the user has
    set in the environment wins. MLflow reads these settings only through its
    ``mlflow.environment_variables`` objects, and its HTTP clients take no per-client limits,
    so each of those objects gets (once per process) a ``get`` that answers from the innermost
    block before falling back to its own reading; outside such a block MLflow behaves as
    shipped, and ``os.environ`` is never written. Transfers that MLflow hands to its own worker
    threads (parallel artifact downloads) keep MLflow's defaults.
    """
    _scope_settings()
    token = _SCOPED.set({**_SCOPED.get(), **limits})
    try:
        yield
    finally:
        _SCOPED.reset(token)


def _scope_settings() -> None:
    from mlflow import environment_variables

    for name in SCOPED_SETTINGS:
        setting = getattr(environment_variables, name)
        if not getattr(setting, "autoprec_scoped", False):
            setting.get = _scoped_get(name, setting.get)
            setting.autoprec_scoped = True


def _scoped_get(name: str, read: Any) -> Any:
    def get() -> Any:
        scoped = _SCOPED.get()
        return scoped[name] if name in scoped and name not in os.environ else read()

    return get


def experiment_id(client: MlflowClient, name: str) -> str:
    """The id of experiment ``name``, created (with :data:`EXPERIMENT_TAGS`) if missing.

    Raises:
        RuntimeError: the experiment exists but is deleted.
    """
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, tags=EXPERIMENT_TAGS)
        except Exception:  # noqa: BLE001 - created meanwhile by another process?
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        raise RuntimeError(
            f"experiment {name!r} is deleted; restore it (`mlflow experiments restore`) or "
            "choose another one (--experiment)"
        )
    return found.experiment_id


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie is gone; on Windows, where
    ``os.kill`` would end it, every process counts as running)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's
        return True
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def end_stale_runs(client: MlflowClient, experiment: str) -> int:
    """End as ``KILLED`` the runs of experiment id ``experiment`` left ``RUNNING`` by a process
    of this host that is gone (their :data:`PID_TAG`); returns how many.

    Runs of other hosts, of live processes, and runs autoprec did not create are left alone.
    """
    host = socket.gethostname()
    query = f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'"
    ended = 0
    for run in client.search_runs([experiment], filter_string=query, max_results=1000):
        pid = run.data.tags.get(PID_TAG, "")
        if not pid.isdigit() or process_alive(int(pid)):
            continue
        client.set_terminated(run.info.run_id, "KILLED")
        ended += 1
    return ended


class GuardedClient:
    """An :class:`mlflow.MlflowClient` whose failures turn tracking off instead of propagating.

    The trackers make their MLflow calls inside :meth:`guard`. The first exception prints one
    line to stderr, ends the runs still open as FAILED and sets :attr:`failed`; tracking must
    never end a search or a training.

    Args:
        tracking_uri: MLflow tracking URI (see :func:`resolve_tracking_uri`).

    Attributes:
        tracking_uri: the resolved URI.
        mlflow: the ``MlflowClient`` once :meth:`connect` succeeded, else None.
        failed: whether a guarded call failed.
        open_runs: runs created and not yet ended, oldest (the parent) first.
    """

    def __init__(self, tracking_uri: str | None = None) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.mlflow: Any = None
        self.failed = False
        self.open_runs: list[str] = []

    def connect(self, experiment: str) -> str:
        """Open the store and return the id of ``experiment`` (created if missing), whose
        runs left ``RUNNING`` by dead processes of this host are ended first
        (:func:`end_stale_runs`, one line on stderr when there were any).

        Processes that open one new SQLite database together (workers started at once) take
        turns: MLflow's table creation is not safe to run twice at the same time.
        """
        from mlflow import MlflowClient

        with sqlite_lock(self.tracking_uri, "mlflow"):
            client = MlflowClient(tracking_uri=self.tracking_uri)
            client.get_experiment_by_name(experiment)
        self.mlflow = client
        found = experiment_id(client, experiment)
        stale = end_stale_runs(client, found)
        if stale:
            print(
                f"autoprec: note: ended {stale} run(s) of experiment {experiment!r} left "
                "RUNNING by a process that is gone as KILLED",
                file=sys.stderr,
                flush=True,
            )
        return found

    def create_run(self, experiment: str, run_name: str, tags: Mapping[str, str]) -> str:
        """Create a run in experiment id ``experiment``, tagged with this process
        (:data:`PID_TAG`, :data:`HOST_TAG`); returns its id (now open)."""
        owner = {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}
        run = self.mlflow.create_run(experiment, run_name=run_name, tags={**tags, **owner})
        self.open_runs.append(run.info.run_id)
        return run.info.run_id

    def log(
        self,
        run_id: str,
        metrics: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        step: int = 0,
    ) -> None:
        """One batch: ``metrics`` (None values left out) at ``step``, ``params`` as strings."""
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        metric_list = [
            Metric(key, float(value), now, step)
            for key, value in (metrics or {}).items()
            if value is not None
        ]
        param_list = [Param(key, str(value)) for key, value in (params or {}).items()]
        self.mlflow.log_batch(run_id, metrics=metric_list, params=param_list)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """End one run with ``status``."""
        self.mlflow.set_terminated(run_id, status)
        self.open_runs.remove(run_id)

    def end_open_runs(self, status: str) -> None:
        """End every open run with ``status``: the newest (nested) first, the parent last."""
        while self.open_runs:
            self.end_run(self.open_runs[-1], status)

    @contextlib.contextmanager
    def guard(self, what: str, limits: Mapping[str, Any] = CALL_LIMITS) -> Iterator[None]:
        """Run MLflow calls under ``limits``; an exception turns tracking off (:meth:`fail`)."""
        try:
            with mlflow_limits(limits):
                yield
        except Exception as err:  # noqa: BLE001 - tracking must never end the work
            self.fail(f"{what} ({self.tracking_uri}): {one_line(err)}")

    def fail(self, reason: str) -> None:
        """Print ``autoprec: tracking off: <reason>`` and end the open runs as FAILED."""
        self.failed = True
        print(f"autoprec: tracking off: {reason}", file=sys.stderr, flush=True)
        if self.open_runs:
            with contextlib.suppress(Exception), mlflow_limits(CONNECT_LIMITS):
                self.end_open_runs("FAILED")
