"""An Optuna study as the agents keep it: its storage, its name, and the workers sharing it.

What :mod:`autoprec.agents.optuna_agents` needs beside its ask/tell loop: opening a storage
URL (an ``RDBStorage`` with a heartbeat, one-line errors with the password hidden), the name
of a new or resumed study, which process a running trial belongs to (and whether it is gone),
the heartbeat an ask-and-tell loop records itself, and Optuna's log level while agents work.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from autoprec._periodic import every
from autoprec._sqlite import sqlite_file, sqlite_lock
from autoprec._text import excerpt

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial, TrialState

    from autoprec.agents.base import Session
    from autoprec.agents.result import Trial

HEARTBEAT_INTERVAL = 10  # seconds between heartbeats of a running trial (RDB storages)
GRACE_PERIOD = 60  # seconds without a heartbeat before another worker fails the trial
MAX_RETRY = 2  # a trial whose worker died is enqueued again at most this often
WORKER_ATTR = "autoprec_worker"
# for PostgreSQL, SQLAlchemy's default driver (2.1 on: psycopg; before: psycopg2)
DRIVER_HINT = "for PostgreSQL: pip install 'psycopg[binary]' (autoprec's postgres extra)"


class StorageError(ValueError):
    """The Optuna storage cannot be opened: driver missing, server unreachable, bad URL."""


def shown_storage(storage: Any) -> str:
    """A storage URL fit to print: the password of ``scheme://user:password@host`` hidden.

    Example:
        >>> shown_storage("postgresql://me:secret@db.example/study")
        'postgresql://me:***@db.example/study'
    """
    return re.sub(r"^([A-Za-z][\w+.-]*://[^:/@]*:)[^@]*@", r"\1***@", str(storage))


@contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's log level at WARNING (or above, if it was) for the block: the agents report
    their trials themselves; it is set back afterwards."""
    import optuna

    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(max(before, optuna.logging.WARNING))
    try:
        yield
    finally:
        optuna.logging.set_verbosity(before)


def study_name_for(storage: Any, name: str, resume: bool = False) -> str:
    """The study a search called ``name`` uses in ``storage``: ``name`` itself when resuming,
    else the first of ``name``, ``name-2``, ``name-3``, ... without trials (a new search
    starts a new study; its predecessors stay for ``--resume`` to find)."""
    if resume or storage is None:
        return name
    import optuna

    try:
        with quiet_optuna():
            summaries = optuna.get_all_study_summaries(storage=storage)
    except Exception:  # noqa: BLE001 - a new or unreadable storage: creating the study says why
        return name
    existing = {s.study_name: s.n_trials for s in summaries}
    candidate, n = name, 1
    while existing.get(candidate, 0) > 0:
        n += 1
        candidate = f"{name}-{n}"
    return candidate


MLFLOW_TABLES = ("experiments", "runs")  # an MLflow tracking database holds these


def check_storage(url: str, tracking_uri: str | None = None) -> None:
    """Refuse a SQLite Optuna storage file that is not a sound database, or that is MLflow's.

    It holds the user's study, not a cache, so it is never replaced: the error says how to
    start over. MLflow's database (``tracking_uri``'s file, or one holding MLflow's tables) is
    refused too: Optuna would add its tables to it, and the two schemas' migrations clash.

    Args:
        url: the Optuna storage URL.
        tracking_uri: the MLflow tracking URI the search logs to (None: it logs nowhere).

    Raises:
        StorageError: one line naming the file and what to do.
    """
    import sqlite3

    path = sqlite_file(url)
    if path is None:
        return
    mlflow_file = sqlite_file(tracking_uri)
    if mlflow_file is not None and _same_file(path, mlflow_file):
        raise _mlflow_database(path)
    if not path.is_file() or path.stat().st_size == 0:
        return  # a new study
    mlflow = False
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
        try:
            rows = db.execute("PRAGMA quick_check").fetchall()
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
            mlflow = set(MLFLOW_TABLES) <= tables
        finally:
            db.close()
        problem = None if rows == [("ok",)] else excerpt(rows[0][0] if rows else "no answer")
    except sqlite3.Error as err:
        problem = str(err)
    if problem is not None:
        raise StorageError(
            f"the Optuna storage {path} is damaged ({problem}): delete or move it to start the "
            "search over, or choose another file with --storage sqlite:///<new>.db"
        )
    if mlflow:
        raise _mlflow_database(path)


def _same_file(a: Any, b: Any) -> bool:
    """Whether the paths ``a`` and ``b`` name one file (existing or not)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one is missing: compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


def _mlflow_database(path: Any) -> StorageError:
    return StorageError(
        f"the Optuna storage {path} is MLflow's tracking database: Optuna would add its tables "
        "to it, and the two clash; give Optuna a file of its own with --storage "
        "sqlite:///<new>.db"
    )


@contextmanager
def ask_lock(url: Any) -> Iterator[None]:
    """Hold, on a SQLite storage, an exclusive lock shared by the processes of this host for
    the block: ``study.ask`` (and the worker's mark on the trial) happen one worker at a time.

    Optuna pops an enqueued (WAITING) trial by reading its state, then setting it RUNNING
    ``FOR UPDATE``, a row lock SQLite does not have: two workers asking together both get the
    same trial, both evaluate it, and the second's ``tell`` finds it finished. PostgreSQL and
    MySQL lock the row; other storages get no lock (:func:`autoprec._sqlite.sqlite_lock`).
    """
    with sqlite_lock(url, "optuna-ask"):
        yield


def open_storage(storage: Any, retry: Callable[..., Any]) -> Any:
    """``storage`` itself, or for a URL an ``RDBStorage`` with a heartbeat whose stale trials
    are given to ``retry``."""
    if not isinstance(storage, str):
        return storage
    import optuna

    name = "heartbeat_stale_trial_callback"  # optuna >= 4.9; before: failed_trial_callback
    if name not in inspect.signature(optuna.storages.RDBStorage).parameters:
        name = "failed_trial_callback"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            storage,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            grace_period=GRACE_PERIOD,
            **{name: retry},
        )


def storage_error(storage: Any, exc: BaseException) -> StorageError:
    """One line naming the storage (password hidden) and, where known, the fix."""
    where = shown_storage(storage)
    if isinstance(exc, ImportError):
        return StorageError(
            f"cannot open Optuna storage {where}: its database driver is not installed; "
            + DRIVER_HINT
        )
    cause = getattr(exc, "orig", None) or exc  # the driver's own error, without SQL
    text = " ".join(str(cause).split()).replace(str(storage), where)
    if len(text) > 200:
        text = text[:197] + "..."
    return StorageError(
        f"cannot open Optuna storage {where}: {text}; check the URL and that the database "
        "server is running"
    )


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


WORKER = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}


def worker_of(trial: optuna.Trial | FrozenTrial) -> dict[str, Any]:
    worker = trial.user_attrs.get(WORKER_ATTR)
    return worker if isinstance(worker, dict) else {}


def dead(worker: Mapping[str, Any]) -> bool:
    """Whether the worker of a trial is a process of this host that is gone (a reused pid
    counts as gone when its start time differs; without one it counts as alive)."""
    pid = worker.get("pid")
    if worker.get("host") != WORKER["host"] or not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return worker.get("start") != WORKER["start"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. another user's process: it exists
        return False
    start = process_start(pid)
    return start is not None and worker.get("start") is not None and start != worker["start"]


def retry_callback() -> Any:
    import optuna

    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return (cls or optuna.storages.RetryFailedTrialCallback)(max_retry=MAX_RETRY)


def heartbeat_interval(storage: object) -> int | None:
    getter = getattr(storage, "get_heartbeat_interval", None)
    return getter() if callable(getter) else None


@contextmanager
def heartbeat(storage: BaseStorage, trial: optuna.Trial) -> Iterator[None]:
    """Record ``trial``'s heartbeat now and every interval until the block ends (what
    ``study.optimize`` does for its trials; ask-and-tell has to do it itself)."""
    interval = heartbeat_interval(storage)
    if interval is None:
        yield
        return
    trial_id = trial._trial_id  # no public name for it
    storage.record_heartbeat(trial_id)

    def beat() -> None:
        try:
            storage.record_heartbeat(trial_id)
        except Exception:  # noqa: BLE001 - a busy database: the next beat tries again
            pass

    with every(interval, beat, "autoprec-heartbeat"):
        yield


def tell(
    study: optuna.Study,
    trial: optuna.Trial,
    values: list[float],
    attrs: Mapping[str, Any] | None = None,
) -> None:
    """Set ``attrs`` as the trial's user attrs, then ``study.tell``; a trial another worker has
    failed meanwhile (its heartbeat was late) keeps its result in this search and in the
    evaluator's cache, where its retry finds it."""
    import optuna

    try:
        for key, value in (attrs or {}).items():
            trial.set_user_attr(key, value)
        study.tell(trial, values)
    except optuna.exceptions.UpdateFinishedTrialError:
        warnings.warn(
            f"trial {trial.number} was failed by another worker (its heartbeat came late); its "
            "retry is served from the evaluator's cache",
            stacklevel=2,
        )


def count(study: optuna.Study, states: tuple[TrialState, ...], below: int | None = None) -> int:
    trials = study.get_trials(deepcopy=False, states=states)
    return sum(1 for t in trials if below is None or t.number < below)


def check_study(study: optuna.Study, session: Session) -> None:
    """Refuse a study made for another model, target or fidelity."""
    problem = session.problem
    meta = {
        "model": problem.evaluator.spec.name,
        "target": problem.evaluator.device.name,
        "fidelity": problem.fidelity,
        "layers": problem.layers(),
    }
    stored = study.user_attrs.get("autoprec")
    if stored is None:
        study.set_user_attr("autoprec", meta)
        return
    differ = sorted(k for k in meta if stored.get(k) != meta[k])
    if differ:
        raise ValueError(
            f"study {study.study_name!r} was made for "
            + ", ".join(f"{k}={stored.get(k)!r}" for k in differ)
            + "; this search has "
            + ", ".join(f"{k}={meta[k]!r}" for k in differ)
            + "; pass another study_name"
        )


def load_trials(study: optuna.Study, session: Session) -> None:
    """Add the study's COMPLETE trials that this search does not hold yet."""
    from optuna.trial import TrialState

    from autoprec.evaluate.metrics import Metrics

    for frozen in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if session.seen(frozen.params) is not None:
            continue
        attrs = frozen.user_attrs
        if "metrics" in attrs:
            metrics = Metrics.from_dict(attrs["metrics"])
        else:  # not written by autoprec: evaluate it (a cache hit if it was)
            metrics = session.problem.evaluate(session.problem.complete(frozen.params))
        extra = {"optuna_trial": frozen.number, "loaded": True}
        if "baseline" in attrs:
            extra["name"] = attrs["baseline"]
        session.load(frozen.params, metrics, float(attrs.get("wall_time_s", 0.0)), **extra)


def user_attrs(trial: Trial) -> dict[str, Any]:
    """The user attrs of a COMPLETE trial, from which :func:`load_trials` rebuilds it."""
    return {
        "metrics": trial.metrics.to_dict(),
        "reward": trial.reward,
        "fidelity": trial.fidelity,
        "wall_time_s": trial.wall_time_s,
    }
