"""MLflow tracking of searches: runs, params, metrics, artifacts; it never ends a search."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

import pytest
from mlflow_runs import PNG, parents_and_children, runs_of
from tinycnn_fixtures import made_up_metrics

from autoprec.agents.base import SearchResult, Trial
from autoprec.cli import main
from autoprec.evaluate import Metrics
from autoprec.policy.io import load_policy
from autoprec.tracking import SearchRunInfo, SearchTracker, policy_digest

FAST = ["--model", "tinycnn", "--steps", "4", "--train-batch-size", "32"]
SEARCH = ["search", *FAST, "--agent", "random", "--budget", "3"]


@pytest.fixture(autouse=True)
def _private(tracked_search_dir):
    return tracked_search_dir


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    """A database shared by the tests below (creating one costs seconds); one experiment each."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_search_logs_a_parent_run_and_a_nested_run_per_evaluation(tmp_path, capsys):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = tmp_path / "best.yaml"
    rc = main([*SEARCH, "--tracking-uri", uri, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "tracking off" not in err and "mlflow: run" in err and "best policy" in err

    parents, children = parents_and_children(runs_of(uri))
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "random-h100-sxm-seed0"
    params = parent.data.params
    assert params["model"] == "tinycnn" and params["agent"] == "random"
    assert params["target"] == "h100-sxm" and params["budget"] == "3"
    assert {"seed", "fidelity", "dataset", "w_speedup", "w_memory", "w_accuracy"} <= set(params)
    assert {"accuracy_tolerance", "autoprec_version", "torch_version"} <= set(params)
    assert (params["recipe_optimizer"], params["recipe_lr"]) == ("sgd", "0.05")  # the recipe
    tags = parent.data.tags
    assert (tags["autoprec.agent"], tags["autoprec.target"]) == ("random", "h100-sxm")
    assert tags["autoprec.model"] == "tinycnn"
    final = parent.data.metrics
    assert final["evaluations"] == 3 and final["surrogate_episodes"] == 0
    for key in ("best_reward", "best_speedup", "best_loss_delta", "best_memory_ratio"):
        assert key in final
    assert {"best_accuracy_delta", "search_wall_time_s", "amp_speedup"} <= set(final)
    # the policy file names its run
    policy = load_policy(out)
    assert policy.provenance["mlflow_run_id"] == parent.info.run_id
    assert final["best_reward"] == pytest.approx(policy.metrics["reward"])

    client = MlflowClient(uri)
    history = client.get_metric_history(parent.info.run_id, "best_reward")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == sorted(m.value for m in history)  # never falls
    evaluations = client.get_metric_history(parent.info.run_id, "evaluations")
    assert [(m.step, m.value) for m in evaluations] == [(1, 1), (2, 2), (3, 3)]

    nested = children[parent.info.run_id]
    assert len(nested) == 3  # one per real evaluation
    numbers = set()
    for run in nested:
        assert run.info.status == "FINISHED"
        for key in ("accuracy", "loss", "val_loss", "accuracy_delta", "loss_delta", "speedup"):
            assert key in run.data.metrics
        for key in ("memory_ratio", "reward", "overflows", "underflows", "wall_time_s"):
            assert key in run.data.metrics
        assert run.data.params["fidelity"] == "short"
        assert not any(key.startswith(("conv", "fc")) for key in run.data.params)
        layers = json.loads(
            Path(client.download_artifacts(run.info.run_id, "policy.json")).read_text()
        )
        assert list(layers) == ["conv1", "conv2", "fc1", "fc2"]  # execution order
        assert run.data.params["policy_digest"] == policy_digest(layers)
        lowered = sum(1 for p in layers.values() if p != "fp32")
        assert run.data.params["lowered_layers"] == str(lowered)
        numbers.add(int(run.data.params["trial"]))
    assert numbers == {0, 1, 2}

    names = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"best_policy.yaml", "pareto.csv", "pareto.png", "precision_map.png"} <= names
    folder = Path(client.download_artifacts(parent.info.run_id, "", dst_path=str(tmp_path / "a")))
    assert (folder / "best_policy.yaml").read_text() == out.read_text()
    rows = (folder / "pareto.csv").read_text().splitlines()
    assert rows[0].startswith("number,reward,loss_delta,accuracy_delta,speedup,memory_ratio")
    assert len(rows) >= 2
    import matplotlib.image

    for name in ("pareto.png", "precision_map.png"):
        data = (folder / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
        image = matplotlib.image.imread(folder / name)
        assert image.shape[0] > 100 and image.shape[1] > 100

    # a second search into the same experiment adds a second parent run
    rc = main([*SEARCH, "--tracking-uri", uri, "--out", str(tmp_path / "again.yaml")])
    assert rc == 0, capsys.readouterr().err
    parents, children = parents_and_children(runs_of(uri))
    assert len(parents) == 2
    assert sorted(len(c) for c in children.values()) == [3, 3]


def test_unreachable_server_turns_tracking_off_and_the_search_goes_on(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    uri = f"http://127.0.0.1:{closed_port()}"
    begin = time.perf_counter()
    rc = main([*SEARCH, "--tracking-uri", uri, "--out", str(out)])
    elapsed = time.perf_counter() - begin
    err = capsys.readouterr().err
    assert rc == 0, err
    assert [line for line in err.splitlines() if "tracking off" in line] == [
        next(line for line in err.splitlines() if line.startswith("autoprec: tracking off:"))
    ]
    assert uri in err and "best policy" in err
    assert "mlflow_run_id" not in load_policy(out).provenance
    assert elapsed < 60  # the search itself; the tracker's part is timed below


def test_closed_port_fails_fast():
    import mlflow  # noqa: F401 - import time is not the tracker's

    tracker = SearchTracker(
        SearchRunInfo("tinycnn"), tracking_uri=f"http://127.0.0.1:{closed_port()}"
    )
    begin = time.perf_counter()
    assert tracker.start() is False
    assert time.perf_counter() - begin < 10
    tracker.on_trial(_trial(0), _result([_trial(0)]))  # ignored, no raise
    tracker.finish(_result([_trial(0)]))


@pytest.mark.parametrize("how", ["flag", "config"])
def test_no_mlflow_creates_no_database(tmp_path, capsys, how):
    out = tmp_path / "best.yaml"
    if how == "flag":
        assert main([*SEARCH, "--no-mlflow", "--out", str(out)]) == 0
    else:
        config = tmp_path / "search.yaml"
        config.write_text("no-mlflow: true\nexperiment: unused\n")
        assert main([*SEARCH, "--config", str(config), "--out", str(out)]) == 0
    assert out.exists()
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    err = capsys.readouterr().err
    assert "mlflow: run" not in err and "tracking off" not in err


def test_interrupted_search_ends_its_run_killed(tmp_path, capsys, monkeypatch, db):
    from mlflow import MlflowClient

    log_trial = SearchTracker.on_trial

    def interrupt_after_two(self, trial, result):
        log_trial(self, trial, result)
        if len(result.real_trials) == 2:
            raise KeyboardInterrupt  # as Ctrl-C or SIGTERM during the search

    monkeypatch.setattr(SearchTracker, "on_trial", interrupt_after_two)
    out = tmp_path / "best.yaml"
    rc = main([*SEARCH, "--tracking-uri", db, "--experiment", "killed", "--out", str(out)])
    assert rc == 130, capsys.readouterr().err
    assert load_policy(out).provenance["interrupted"] == "true"
    parents, children = parents_and_children(runs_of(db, "killed"))
    assert len(parents) == 1 and parents[0].info.status == "KILLED"
    nested = children[parents[0].info.run_id]
    assert len(nested) == 2 and all(r.info.status == "FINISHED" for r in nested)
    names = {a.path for a in MlflowClient(db).list_artifacts(parents[0].info.run_id)}
    assert {"best_policy.yaml", "pareto.csv", "pareto.png", "precision_map.png"} <= names


# --- the tracker on its own (no search: made-up trials) ------------------------------------
def _metrics(speedup: float = 1.5, loss_delta: float = 0.01, fidelity: str = "short") -> Metrics:
    return made_up_metrics(
        loss=0.3, fp32_loss=0.3, loss_delta=loss_delta, speedup=speedup, memory_ratio=0.7,
        step_time_s=0.01, memory_bytes=1000, fidelity=fidelity,
    )  # fmt: skip


def _trial(number: int, fidelity: str = "short", speedup: float = 1.5) -> Trial:
    policy = {"conv1": "fp32", "conv2": "bf16", "fc1": "fp8", "fc2": "fp32"}
    return Trial(number, policy, _metrics(speedup, fidelity=fidelity), 0.1 * number, fidelity, 0.5)


def _result(trials: list[Trial]) -> SearchResult:
    return SearchResult(agent="random", trials=trials, budget=3, target="h100-sxm")


def test_surrogate_trials_are_counted_not_logged_and_killed_is_kept(db):
    from mlflow import MlflowClient

    tracker = SearchTracker(SearchRunInfo("unit", agent="ppo", target="h100-sxm"), tracking_uri=db)
    trials = [_trial(0, "surrogate"), _trial(1), _trial(2, "surrogate"), _trial(3, speedup=2.0)]
    with tracker:
        assert tracker.active and tracker.run_id
        for i, trial in enumerate(trials):
            tracker.on_trial(trial, _result(trials[: i + 1]))
        tracker.on_trial(trials[1], _result(trials))  # told twice: still one run
        tracker.finish(_result(trials), status="KILLED")
    assert not tracker.active
    parents, children = parents_and_children(runs_of(db, "autoprec/unit"))
    assert len(parents) == 1 and parents[0].info.status == "KILLED"
    assert sorted(r.data.params["trial"] for r in children[tracker.run_id]) == ["1", "3"]
    metrics = parents[0].data.metrics
    assert metrics["surrogate_episodes"] == 2 and metrics["evaluations"] == 2
    names = {a.path for a in MlflowClient(db).list_artifacts(tracker.run_id)}
    assert "best_policy.yaml" not in names  # none was given
    assert {"pareto.csv", "pareto.png", "precision_map.png"} <= names


def test_a_failing_mlflow_call_turns_tracking_off_once(db, capsys):
    tracker = SearchTracker(SearchRunInfo("broken"), tracking_uri=db)
    assert tracker.start()

    def fail(*args, **kwargs):
        raise RuntimeError("disk full\nsecond line")

    tracker.client.mlflow.log_batch = fail
    trials = [_trial(0), _trial(1)]
    tracker.on_trial(trials[0], _result(trials[:1]))  # fails: tracking off
    tracker.on_trial(trials[1], _result(trials))  # ignored
    tracker.finish(_result(trials))
    tracker.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("autoprec: tracking off:")
    assert "disk full second line" in lines[0]
    runs = runs_of(db, "autoprec/broken")
    assert {r.info.status for r in runs} == {"FAILED"}  # the parent and the half-logged trial


@pytest.mark.parametrize("uri", ["nosuch://host/x", "http://[::1"])
def test_a_malformed_uri_turns_tracking_off(uri, capsys):
    tracker = SearchTracker(SearchRunInfo("tinycnn"), tracking_uri=uri)
    assert tracker.start() is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autoprec: tracking off:") and uri in err[0]


def test_disabled_tracker_does_nothing(tmp_path):
    tracker = SearchTracker(SearchRunInfo("tinycnn"), enabled=False)
    assert tracker.start() is False
    tracker.on_trial(_trial(0), _result([_trial(0)]))
    tracker.finish(_result([_trial(0)]))
    assert tracker.run_id is None and not (tmp_path / "mlflow.db").exists()


def test_defaults_and_bad_status(monkeypatch):
    assert SearchTracker(SearchRunInfo("m")).tracking_uri == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    info = SearchRunInfo("m", agent="tpe", target="a100", seed=3)
    tracker = SearchTracker(info)
    assert tracker.info is info
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.seed = 4  # type: ignore[misc]
    assert tracker.tracking_uri == "http://tracking:5000"
    assert (tracker.experiment, tracker.run_name) == ("autoprec/m", "tpe-a100-seed3")
    with pytest.raises(ValueError, match="unknown run status"):
        tracker.finish(_result([]), status="DONE")
    assert policy_digest({"a": "fp32", "b": "bf16"}) == policy_digest({"b": "bf16", "a": "fp32"})
    assert policy_digest({"a": "fp32"}) != policy_digest({"a": "bf16"})


def test_reward_settings_are_parent_params(db):
    from autoprec.evaluate.reward import RewardConfig

    reward = RewardConfig({"accuracy": 20.0}, tolerance=0.02)
    tracker = SearchTracker(SearchRunInfo("rewarded", reward=reward), tracking_uri=db)
    with tracker:
        assert tracker.start()
    (run,) = runs_of(db, "autoprec/rewarded")
    params = run.data.params
    assert (params["w_speedup"], params["w_memory"], params["w_accuracy"]) == ("1.0", "0.5", "20.0")
    assert params["accuracy_tolerance"] == "0.02"
    assert SearchTracker(SearchRunInfo("m")).reward == RewardConfig()


def test_http_limits_hold_only_inside_autoprec_calls(monkeypatch):
    import os

    from mlflow.environment_variables import (
        MLFLOW_HTTP_REQUEST_MAX_RETRIES,
        MLFLOW_HTTP_REQUEST_TIMEOUT,
    )

    from autoprec.tracking import CALL_LIMITS, CONNECT_LIMITS, mlflow_limits

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    before = dict(os.environ)
    shipped = MLFLOW_HTTP_REQUEST_TIMEOUT.get()
    with mlflow_limits(CALL_LIMITS):
        assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 30
        with mlflow_limits(CONNECT_LIMITS):
            assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 5
            assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 0
        assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 2
        assert dict(os.environ) == before  # the process's environment is never written
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == shipped
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")  # the user's setting wins
    with mlflow_limits(CONNECT_LIMITS):
        assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 77
