"""Evaluations run side by side in worker processes: same results, fallbacks, the CLI's rule."""

from __future__ import annotations

import os
import signal

import pytest

from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.pipeline.evaluations import AUTO_WORKERS, MIN_REFERENCE_S, chosen_workers

SMALL = {"steps": 4, "warm_start_steps": 20}
TARGET = "h100-sxm"
RESULTS = ("loss", "val_loss", "accuracy", "loss_delta", "speedup", "memory_ratio", "steps")


def _same_results(a, b) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in RESULTS)


@pytest.mark.slow
def test_workers_give_the_results_a_run_here_gives_and_count_as_runs(spec, data, tmp_path):
    here = Evaluator(
        spec, data, TARGET, cache_dir=tmp_path / "here", config=EvaluatorConfig(**SMALL)
    )
    expected = {p: here.evaluate(p) for p in ("bf16", "fp8")}  # one thread, as each worker
    pooled = Evaluator(
        spec, data, TARGET, cache_dir=tmp_path / "pooled", config=EvaluatorConfig(**SMALL)
    )
    pooled.reference()
    assert pooled.worker_evaluation_s() is None  # no workers
    assert pooled.start_workers(2) is None and pooled.worker_threads == 1
    try:
        assert pooled.worker_evaluation_s() is None  # none finished
        assert pooled.prefetch(["bf16", "fp8", "bf16"]) == 2  # a repeat is not started again
        got = {p: pooled.evaluate(p) for p in ("bf16", "fp8")}
        # the workers' CPU time of the runs taken, about their wall time (one thread each)
        walls = [got[p].wall_time_s for p in got]
        assert 0 < pooled.worker_evaluation_s() <= 1.5 * max(walls)
        assert pooled.runs == 3  # the reference here, two in the workers
        assert pooled.prefetch(["bf16"]) == 0  # cached now
    finally:
        pooled.stop_workers()
    for p in expected:
        assert _same_results(got[p], expected[p]), p


def test_a_worker_that_dies_costs_a_warning_and_the_run_is_done_here(spec, data, tmp_path):
    ev = Evaluator(spec, data, TARGET, cache_dir=tmp_path / "c", config=EvaluatorConfig(**SMALL))
    ev.reference()
    assert ev.start_workers(2) is None
    try:
        ev.prefetch(["fp16"])
        for process in list(ev._pool._executor._processes.values()):
            os.kill(process.pid, signal.SIGKILL)
        with pytest.warns(UserWarning, match="worker processes stopped"):
            got = ev.evaluate("fp16")
        assert not ev._pool.open and ev.prefetch(["bf16"]) == 0  # one process from now on
    finally:
        ev.stop_workers()
    here = Evaluator(
        spec, data, TARGET, cache_dir=tmp_path / "here", config=EvaluatorConfig(**SMALL)
    )
    assert _same_results(got, here.evaluate("fp16"))


def test_no_workers_when_fewer_than_two_are_asked(spec, data, tmp_path):
    ev = Evaluator(spec, data, TARGET, cache_dir=tmp_path / "c", config=EvaluatorConfig(**SMALL))
    assert "1 worker(s)" in ev.start_workers(1)
    assert ev.prefetch(["bf16"]) == 0 and ev.worker_threads == 0
    ev.stop_workers()  # nothing to stop


def test_the_default_uses_workers_only_for_models_that_take_long(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert chosen_workers(None, MIN_REFERENCE_S) == AUTO_WORKERS
    assert chosen_workers(None, MIN_REFERENCE_S / 2) == 0  # spawning would not pay
    assert chosen_workers(3, 0.1) == 3 and chosen_workers(0, 100.0) == 0  # as asked
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert chosen_workers(None, 100.0) == 0


def test_a_pool_given_no_work_stops_its_workers(spec, data, tmp_path):
    """Workers start with the pool; one that never gets a run (every evaluation cached) must
    still exit when the pool closes, else the interpreter's exit waits for them forever (a PPO
    search on a full cache hung so)."""
    ev = Evaluator(spec, data, TARGET, cache_dir=tmp_path / "c", config=EvaluatorConfig(**SMALL))
    ev.reference()
    assert ev.start_workers(2) is None
    processes = list(ev._pool._executor._processes.values())
    assert len(processes) == 2
    ev.stop_workers()
    for process in processes:
        process.join(timeout=30)
    assert [p.exitcode for p in processes] == [0, 0]
