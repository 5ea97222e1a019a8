"""Reading back what autoprec logged to MLflow, for the tests of tracking, verify and faults."""

from __future__ import annotations

PNG = b"\x89PNG\r\n\x1a\n"


def runs_of(uri: str, experiment: str = "autoprec/tinycnn"):
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=[experiment], output_format="list")


def parents_and_children(runs):
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {p.info.run_id: [] for p in parents}
    for r in runs:
        if "mlflow.parentRunId" in r.data.tags:
            children[r.data.tags["mlflow.parentRunId"]].append(r)
    return parents, children
