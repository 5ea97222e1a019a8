"""``autoprec compare``: logged searches read back from MLflow as rows, CSV and a Pareto chart."""

from __future__ import annotations

import csv
import socket
from pathlib import Path

import pytest

from autoprec.cli import main
from autoprec.tracking.compare import CompareError, compare_searches, sort_rows

FAST = ["--model", "tinycnn", "--steps", "4", "--train-batch-size", "32", "--budget", "2"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict[str, str]:
    """Two tiny real searches (random, baseline) logged into one SQLite store."""
    root = tmp_path_factory.mktemp("compare")
    uri = f"sqlite:///{root}/mlflow.db"
    ids = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPREC_CACHE_DIR", str(root / "cache"))
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)  # mlruns/ and the search's side files land here
        for agent in ("random", "baseline"):
            out = root / f"{agent}.yaml"
            args = ["search", *FAST, "--agent", agent, "--tracking-uri", uri, "--out", str(out)]
            assert main(args) == 0
            from autoprec.policy.io import load_policy

            ids[agent] = load_policy(out).provenance["mlflow_run_id"]
    return {"uri": uri, **ids}


@pytest.fixture(autouse=True)
def _here(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


def test_compare_searches_returns_one_row_per_search(store):
    rows = compare_searches(store["uri"])
    assert sorted(r["agent"] for r in rows) == ["baseline", "random"]
    by_agent = {r["agent"]: r for r in rows}
    for agent in ("random", "baseline"):
        row = by_agent[agent]
        assert row["run_id"] == store[agent]
        assert (row["experiment"], row["model"], row["target"]) == (
            "autoprec/tinycnn",
            "tinycnn",
            "h100-sxm",
        )
        assert row["budget"] == 2 and row["evaluations"] == 2 and row["status"] == "FINISHED"
        for key in ("best_reward", "speedup", "memory_ratio", "loss_delta", "accuracy_delta"):
            assert isinstance(row[key], float)
        assert row["wall_time_s"] >= 0 and row["start_time"].endswith("+00:00")
        assert len(row["start_time"]) == len("2026-01-01T00:00:00.000+00:00")  # to the ms
    assert compare_searches(store["uri"], model="tinycnn") == rows
    assert compare_searches(store["uri"], model="mlp") == []
    assert compare_searches(store["uri"], experiment="autoprec/tinycnn", model="mlp") == []


def test_sort_rows_best_first_with_direction_and_missing_last():
    rows = [
        {"run_id": "a", "best_reward": 0.1, "loss_delta": 0.3},
        {"run_id": "b", "best_reward": None, "loss_delta": 0.1},
        {"run_id": "c", "best_reward": 0.5, "loss_delta": 0.2},
    ]
    assert [r["run_id"] for r in sort_rows(rows)] == ["c", "a", "b"]
    assert [r["run_id"] for r in sort_rows(rows, "best_reward:asc")] == ["a", "c", "b"]
    assert [r["run_id"] for r in sort_rows(rows, "loss-delta")] == ["b", "c", "a"]
    assert [r["run_id"] for r in sort_rows(rows, "loss_delta:desc")] == ["a", "c", "b"]
    with pytest.raises(CompareError, match="unknown sort column 'nope'.*best_reward"):
        sort_rows(rows, "nope")


def test_sort_rows_breaks_ties_newest_first_then_by_run_id():
    rows = [
        {"run_id": "b", "agent": "tpe", "start_time": "2026-01-01T00:00:01.000+00:00"},
        {"run_id": "c", "agent": "tpe", "start_time": "2026-01-01T00:00:01.250+00:00"},
        {"run_id": "a", "agent": "tpe", "start_time": "2026-01-01T00:00:01.000+00:00"},
        {"run_id": "d", "agent": None, "start_time": "2026-01-01T00:00:00.000+00:00"},
    ]
    for order in (rows, rows[::-1]):  # whatever order the store returns
        assert [r["run_id"] for r in sort_rows(order, "agent")] == ["c", "a", "b", "d"]
        assert [r["run_id"] for r in sort_rows(order, "start_time")] == ["c", "a", "b", "d"]
        assert [r["run_id"] for r in sort_rows(order, "start_time:asc")] == ["d", "a", "b", "c"]


def test_cli_table_csv_and_plot(store, tmp_path, capsys):
    table_csv, chart = tmp_path / "out" / "runs.csv", tmp_path / "fronts.png"
    args = ["compare", "--tracking-uri", store["uri"], "--csv", str(table_csv)]
    assert main([*args, "--plot", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "2 searches in autoprec/tinycnn" in out
    assert store["random"][:8] in out and store["baseline"][:8] in out
    lines = [line for line in out.splitlines() if store["random"][:8] in line]
    assert len(lines) == 1 and "random" in lines[0] and "h100-sxm" in lines[0]
    assert "2 Pareto fronts" in out

    with table_csv.open(newline="") as fh:
        records = list(csv.DictReader(fh))
    assert len(records) == 2
    assert {r["agent"] for r in records} == {"random", "baseline"}
    assert {r["run_id"] for r in records} == {store["random"], store["baseline"]}
    rewards = [float(r["best_reward"]) for r in records]
    assert rewards == sorted(rewards, reverse=True)  # default: best reward first

    data = chart.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    assert not [p for p in chart.parent.iterdir() if p.suffix == ".tmp"]  # written atomically


def test_cli_sort_orders_the_rows(store, tmp_path, capsys):
    def order(sort: str) -> list[str]:
        path = tmp_path / f"{sort.replace(':', '_')}.csv"
        assert (
            main(["compare", "--tracking-uri", store["uri"], "--sort", sort, "--csv", str(path)])
            == 0
        )
        with path.open(newline="") as fh:
            return [r["agent"] for r in csv.DictReader(fh)]

    assert order("agent") == ["baseline", "random"]
    assert order("agent:desc") == ["random", "baseline"]
    assert order("start_time") == ["baseline", "random"]  # newest first
    assert order("start_time:asc") == ["random", "baseline"]
    capsys.readouterr()
    assert main(["compare", "--tracking-uri", store["uri"], "--sort", "colour"]) == 2
    err = capsys.readouterr().err
    assert "unknown sort column 'colour'" in err and err.count("\n") == 1


def test_unknown_experiment_exits_2_and_lists_the_known_ones(store, capsys):
    assert main(["compare", "--tracking-uri", store["uri"], "--experiment", "autoprec/nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "'autoprec/nope' does not exist" in err and "autoprec/tinycnn" in err


def test_no_searches_is_one_line_and_exit_0(store, tmp_path, capsys):
    assert main(["compare", "--tracking-uri", store["uri"], "--model", "mlp"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no autoprec searches" in out and "autoprec/mlp" in out
    missing = tmp_path / "none.db"
    assert main(["compare", "--tracking-uri", f"sqlite:///{missing}"]) == 0
    assert "no autoprec searches" in capsys.readouterr().out
    assert not missing.exists()  # reading never creates a database


def test_unreachable_tracking_server_exits_2_in_one_line(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["compare", "--tracking-uri", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "cannot read searches" in err and "cannot connect" in err


def test_plot_fronts_of_one_search_and_of_a_missing_run(store, tmp_path):
    from autoprec.tracking.compare import plot_fronts

    rows = compare_searches(store["uri"])
    fake = {**rows[0], "run_id": "0" * 32}  # no such run: no artifacts
    with pytest.raises(CompareError, match="cannot read Pareto fronts"):
        plot_fronts([*rows, fake], Path(tmp_path / "x.png"), store["uri"])
    drawn = plot_fronts(rows[:1], tmp_path / "one.png", store["uri"])
    assert drawn == [rows[0]["run_id"]]
    assert (tmp_path / "one.png").read_bytes().startswith(PNG)
