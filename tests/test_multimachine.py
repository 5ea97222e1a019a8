"""The multi-machine parts against real services: a PostgreSQL study, an MLflow server.

* two ``autoprec search --agent tpe`` processes (own caches, as on two machines) on one
  PostgreSQL study end with exactly the budget and no policy evaluated twice;
* a search and ``autoprec compare`` against an HTTP tracking server log and read back the
  same runs as with the SQLite store;
* the server killed mid-search costs one line and no evaluation.

The services come from tests/services.py (skipped without the binaries, failed under CI).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from services import mlflow_server, postgres_url  # noqa: F401 - fixtures

from autoprec.cli import main
from autoprec.policy.io import load_policy
from autoprec.tracking import SearchTracker
from autoprec.tracking.compare import compare_searches

pytestmark = [pytest.mark.services, pytest.mark.slow]

CLI = [sys.executable, "-c", "import sys; from autoprec.cli import main; sys.exit(main())"]
FAST = ["--model", "tinycnn", "--steps", "4", "--train-batch-size", "32"]
BUDGET = 5


@pytest.fixture(autouse=True)
def _private(tracked_search_dir):
    return tracked_search_dir


# -- PostgreSQL ------------------------------------------------------------------------------
def test_two_tpe_processes_share_one_postgres_study(postgres_url, tmp_path):  # noqa: F811
    assert postgres_url.startswith("postgresql://autoprec:")  # user:password@host, as in README
    study_name = "two-machines"
    cmd = [*CLI, "search", *FAST, "--agent", "tpe", "--budget", str(BUDGET), "--no-mlflow"]
    cmd += ["--storage", postgres_url, "--study-name", study_name]
    workers = []
    for i in range(2):  # the same command on two "machines": each has its own cache
        env = {**os.environ, "AUTOPREC_CACHE_DIR": str(tmp_path / f"cache{i}")}
        out = ["--out", str(tmp_path / f"w{i}.yaml")]
        workers.append(subprocess.Popen([*cmd, *out], env=env, stderr=subprocess.PIPE, text=True))
    errors = []
    for w in workers:
        _, err = w.communicate(timeout=300)
        errors.append(err)
        assert w.returncode == 0, err
    for err in errors:
        assert "Traceback" not in err
        assert postgres_url.split("@")[0].split(":")[-1] not in err  # the password is not shown

    study = optuna.load_study(study_name=study_name, storage=postgres_url)
    by_state: dict[str, list[Any]] = {}
    for t in study.trials:
        by_state.setdefault(t.state.name, []).append(t)
    complete = by_state.get("COMPLETE", [])
    assert len(complete) == BUDGET  # none lost, none beyond the budget
    keys = [tuple(sorted(t.params.items())) for t in complete]
    assert len(set(keys)) == len(keys)  # no policy evaluated twice
    assert all("metrics" in t.user_attrs for t in complete)
    assert not by_state.get("RUNNING")
    # Both workers enqueue the baselines on the new study, and one may ask a sampled trial
    # before the other's baselines are in: a baseline can then be left over the budget. It
    # stays enqueued for a resumed search; no copy of an evaluated policy is left waiting.
    evaluated = {tuple(sorted(t.params.items())) for t in complete}
    for t in by_state.get("WAITING", []):
        assert "baseline" in t.user_attrs
        assert tuple(sorted(t.system_attrs["fixed_params"].items())) not in evaluated
    for t in by_state.get("PRUNED", []):  # proposals of a policy already taken: not evaluated
        assert "duplicate_of" in t.user_attrs and "metrics" not in t.user_attrs
    for t in by_state.get("FAIL", []):  # asked when the other worker had filled the budget
        assert "autoprec_skipped" in t.user_attrs and "metrics" not in t.user_attrs
    for i in range(2):
        assert load_policy(tmp_path / f"w{i}.yaml").provenance["budget"] == BUDGET
    print(
        "postgres study:",
        {state: len(trials) for state, trials in by_state.items()},
        "policies:",
        len(set(keys)),
    )


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://me:hunter2@127.0.0.1:{port}/study", "Connection refused"),
        ("postgresql+pg8000://me:hunter2@127.0.0.1:{port}/study", "pip install 'psycopg[binary]'"),
    ],
)
def test_storage_that_cannot_be_opened_is_one_line_without_the_password(url, says, capsys):
    from services import free_port

    url = url.format(port=free_port())  # nothing listens there
    args = ["search", *FAST, "--agent", "tpe", "--budget", "1", "--no-mlflow"]
    assert main([*args, "--storage", url, "--study-name", "s"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("autoprec: error:")]
    assert "cannot open Optuna storage postgresql" in line and says in line
    assert "me:***@127.0.0.1" in line
    assert "hunter2" not in err and "Traceback" not in err


# -- MLflow server ---------------------------------------------------------------------------
SEARCH = ["search", *FAST, "--agent", "random", "--budget", "3"]


def _timing(key: str) -> bool:
    return "wall_time" in key


def _logged(uri: str, tmp: Path) -> dict[str, Any]:
    """What one store holds of its one search, less ids and timings."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("autoprec/tinycnn")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) + 1 == len(runs)

    def metrics(run: Any) -> dict[str, float]:
        return {k: v for k, v in run.data.metrics.items() if not _timing(k)}

    def history(run_id: str, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]

    folder = Path(client.download_artifacts(parent.info.run_id, "", str(tmp)))
    with (folder / "pareto.csv").open(newline="") as fh:
        pareto = [{k: v for k, v in r.items() if k != "run_id"} for r in csv.DictReader(fh)]
    nested = []
    for run in sorted(children, key=lambda r: int(r.data.params["trial"])):
        policy = client.download_artifacts(run.info.run_id, "policy.json", str(tmp))
        nested.append(
            {
                "name": run.info.run_name,
                "status": run.info.status,
                "params": run.data.params,
                "metrics": metrics(run),
                "policy": json.loads(Path(policy).read_text()),
            }
        )
    return {
        "name": parent.info.run_name,
        "status": parent.info.status,
        "params": parent.data.params,
        "tags": {k: v for k, v in parent.data.tags.items() if k.startswith("autoprec.")},
        "metrics": metrics(parent),
        "best_reward": history(parent.info.run_id, "best_reward"),
        "evaluations": history(parent.info.run_id, "evaluations"),
        "artifacts": sorted(p.name for p in folder.iterdir()),
        "pareto": pareto,
        "nested": nested,
        "run_id": parent.info.run_id,
    }


def _compare_csv(uri: str, path: Path) -> list[dict[str, str]]:
    assert main(["compare", "--tracking-uri", uri, "--csv", str(path)]) == 0
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_search_and_compare_through_an_mlflow_server_match_sqlite(
    mlflow_server,  # noqa: F811
    tmp_path,
    capsys,
):
    sqlite = f"sqlite:///{tmp_path / 'mlflow.db'}"
    stores = {"sqlite": sqlite, "server": mlflow_server.uri}
    ids = {}
    for name, uri in stores.items():
        out = tmp_path / f"{name}.yaml"
        assert main([*SEARCH, "--tracking-uri", uri, "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert "tracking off" not in err and "mlflow: run" in err, err
        ids[name] = load_policy(out).provenance["mlflow_run_id"]
    assert ids["sqlite"] != ids["server"]

    logged = {name: _logged(uri, tmp_path / name) for name, uri in stores.items()}
    for name in stores:
        assert logged[name].pop("run_id") == ids[name]  # the policy names its run
    assert logged["server"] == logged["sqlite"]  # the same runs, params, metrics, artifacts
    server = logged["server"]
    assert server["status"] == "FINISHED" and len(server["nested"]) == 3
    assert {"best_policy.yaml", "pareto.csv", "pareto.png", "precision_map.png"} <= set(
        server["artifacts"]
    )

    # read back by autoprec compare: the same rows, the plot from the served artifacts
    rows = {name: compare_searches(uri) for name, uri in stores.items()}
    assert [r["run_id"] for r in rows["server"]] == [ids["server"]]
    varying = ("run_id", "start_time", "wall_time_s")
    same = [{k: v for k, v in r.items() if k not in varying} for r in rows["server"]]
    assert same == [{k: v for k, v in r.items() if k not in varying} for r in rows["sqlite"]]
    capsys.readouterr()
    table = {name: _compare_csv(uri, tmp_path / f"{name}.csv") for name, uri in stores.items()}
    assert [r["run_id"] for r in table["server"]] == [ids["server"]]
    strip = [{k: v for k, v in r.items() if k not in varying} for r in table["server"]]
    assert strip == [{k: v for k, v in r.items() if k not in varying} for r in table["sqlite"]]
    chart = tmp_path / "fronts.png"
    assert main(["compare", "--tracking-uri", mlflow_server.uri, "--plot", str(chart)]) == 0
    out = capsys.readouterr().out
    assert ids["server"][:8] in out and "1 Pareto fronts" in out
    assert chart.read_bytes().startswith(b"\x89PNG")
    print("run ids:", ids)


def test_killed_server_costs_one_line_and_no_evaluation(
    mlflow_server,  # noqa: F811
    tmp_path,
    capsys,
    monkeypatch,
):
    from mlflow import MlflowClient

    log_trial = SearchTracker.on_trial
    killed_after: list[int] = []

    def kill_after_the_first(self, trial, result):
        log_trial(self, trial, result)
        if not killed_after and len(result.real_trials) == 1:
            mlflow_server.kill()  # SIGKILL, mid-search: one trial is logged, the rest not
            killed_after.append(len(self.trial_runs))

    monkeypatch.setattr(SearchTracker, "on_trial", kill_after_the_first)
    out = tmp_path / "best.yaml"
    budget = 4
    args = ["search", *FAST, "--agent", "random", "--budget", str(budget)]
    assert main([*args, "--tracking-uri", mlflow_server.uri, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert killed_after == [1] and not mlflow_server.alive()
    off = [line for line in err.splitlines() if "tracking off" in line]
    assert len(off) == 1 and off[0].startswith("autoprec: tracking off: ")
    assert mlflow_server.uri in off[0] and "Traceback" not in err
    assert f"({budget} real evaluations)" in err  # the whole budget
    trials = (tmp_path / "best.trials.csv").read_text().splitlines()
    assert len(trials) == 1 + budget
    policy = load_policy(out)
    assert policy.provenance["interrupted"] == "false"
    print("the one line:", off[0])

    # what reached the server before it died is in its backend store
    client = MlflowClient(f"sqlite:///{mlflow_server.root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("autoprec/tinycnn")
    runs = client.search_runs([experiment.experiment_id])
    assert len([r for r in runs if "mlflow.parentRunId" in r.data.tags]) == 1
