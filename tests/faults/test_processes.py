"""A search's processes, progress and tracking under kills (issue 34).

The kills need real processes: ``autoprec search`` runs in a subprocess, its descendants are
read from ``/proc``, and after SIGKILL of the search every one of them must be gone within a
bounded wait (its evaluation workers and multiprocessing's resource tracker).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")

CLI = [sys.executable, "-c", "import sys; from autoprec.cli import main; sys.exit(main())"]
GONE_WITHIN_S = 20.0  # after SIGKILL of a parent, its descendants are gone by then
START_WITHIN_S = 240.0  # a search reaches its workers by then, even on a loaded machine


def _parent_and_state(pid: int) -> tuple[int, str] | None:
    """``(parent pid, state letter)`` of a live process, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (found := _parent_and_state(int(entry.name))) is not None:
            parents[int(entry.name)] = found[0]
    below, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in below:
                below.add(child)
                todo.append(child)
    return below


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie is gone: it only waits to be reaped)."""
    return {pid for pid in pids if (found := _parent_and_state(pid)) and found[1] != "Z"}


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def wait_gone(pids: set[int]) -> set[int]:
    """Poll up to :data:`GONE_WITHIN_S` until none of ``pids`` runs; those still running (each
    then killed, so that a failing test leaves no orphan behind)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(pids)
    named = {pid: command(pid) for pid in left}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return set(named.items())


@pytest.mark.slow
def test_sigkill_of_a_search_leaves_no_worker_nor_resource_tracker(tmp_path):
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(tmp_path / "cache")}
    args = ["search", "--model", "tinycnn", "--train-batch-size", "32", "--no-mlflow"]
    # evaluations long enough that the search is still running when it is killed
    args += ["--agent", "random", "--budget", "50", "--steps", "400", "--workers", "2"]
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*CLI, *args, "--out", str(tmp_path / "best.yaml")], env=env, stderr=err, cwd=tmp_path
        )
    try:
        deadline = time.monotonic() + START_WITHIN_S
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, f"the search ended first: {log.read_text()[-2000:]}"
            below = descendants(proc.pid)
            workers = {pid for pid in below if "spawn_main" in command(pid)}
            time.sleep(0.2)
        assert len(workers) == 2, f"no 2 workers in {START_WITHIN_S:g} s: {log.read_text()[-2000:]}"
        below = descendants(proc.pid)  # the workers and the resource tracker
        assert any("resource_tracker" in command(pid) for pid in below), below
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert wait_gone(below) == set(), "orphans after SIGKILL of the search"


WATCHED = """
import os, sys, time
from autoprec.evaluate.pool import die_with_parent
die_with_parent(os.getppid(), kernel=False)
print(os.getpid(), flush=True)
time.sleep(120)
"""
MIDDLE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]])
time.sleep(120)
"""


def test_without_the_kernels_signal_the_watchdog_ends_a_worker_whose_parent_died():
    """The portable half of :func:`die_with_parent`: a process whose parent is SIGKILLed
    exits on its own (no ``prctl``), as a worker does off Linux."""
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, WATCHED], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(middle.stdout.readline())  # printed once it watches
        assert alive({child}) == {child}
    finally:
        middle.kill()
        middle.wait(timeout=30)
    assert wait_gone({child}) == set(), "the watched process outlived its parent"


# --- MLflow runs of killed searches ----------------------------------------------------------
def _status(uri: str, run_id: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient(uri).get_run(run_id).info.status


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_run_left_running_by_a_killed_process_is_ended_killed_by_the_next_one(tmp_path, capsys):
    from autoprec.tracking import SearchRunInfo, SearchTracker
    from autoprec.tracking.client import PID_TAG

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    killed = SearchTracker(
        SearchRunInfo("stale", agent="random", target="h100-sxm"), tracking_uri=uri
    )
    assert killed.start()  # then its process "dies" without ending it, as under SIGKILL:
    killed.client.mlflow.set_tag(killed.run_id, PID_TAG, str(_dead_pid()))
    capsys.readouterr()
    live = SearchTracker(
        SearchRunInfo("stale", agent="random", target="h100-sxm"), tracking_uri=uri
    )
    try:
        assert live.start()
        assert _status(uri, killed.run_id) == "KILLED"
        assert "ended 1 run(s) of experiment 'autoprec/stale'" in capsys.readouterr().err
        again = SearchTracker(
            SearchRunInfo("stale", agent="tpe", target="h100-sxm"), tracking_uri=uri
        )
        assert again.start()  # a run of a live process (this one) is left alone
        assert _status(uri, live.run_id) == "RUNNING"
        again.close("FINISHED")
    finally:
        live.close("FINISHED")
    assert _status(uri, live.run_id) == "FINISHED"


# --- progress that tells the truth ---------------------------------------------------------
def _plain_console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=False, width=80)


def _until(seen, needle: str, within: float = 20.0) -> bool:
    """Poll ``seen()`` (bounded) until it holds ``needle``."""
    deadline = time.monotonic() + within
    while needle not in seen() and time.monotonic() < deadline:
        time.sleep(0.01)
    return needle in seen()


def test_off_a_terminal_a_long_phase_says_it_is_working(monkeypatch):
    import autoprec.cli.search_progress as progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.01)
    console = _plain_console()
    with progress.working(console, "fp32 reference"):
        assert _until(console.file.getvalue, "fp32 reference: still working (")


def test_off_a_terminal_the_search_prints_each_evaluation_and_the_time_left(monkeypatch):
    from types import SimpleNamespace

    import autoprec.cli.search_progress as progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.01)
    console = _plain_console()
    seen = []
    with progress.Progress(console, 3, seen.append, evaluation_s=60.0) as bar:
        # before any evaluation finished: the time left from one evaluation's expected time
        assert _until(console.file.getvalue, "search: evaluation 1 of 3 running for")
        assert bar.time_left(bar.last) == 180.0 and "about" in bar.running_line()
        assert bar.time_left(bar.last + 100) == 120.0  # at least the two after it
        trial = SimpleNamespace(real=True)
        bar.on_trial(trial, SimpleNamespace(real_trials=[trial], best=None))
        assert _until(console.file.getvalue, "evaluation 2 of 3 running for")
    text = console.file.getvalue()
    assert "search: 1/3 evaluations (" in text and "left) · surrogate episodes 0" in text
    assert len(seen) == 1 and "ETA" not in text  # plain lines, no rich bar
    assert progress.duration(59.6) == "1 min 0 s" and progress.duration(7322) == "2 h 2 min"


def test_fp32_training_reports_every_step_of_every_attempt():
    import torch

    from autoprec.training.pretrain import train_fp32

    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    told = []
    loss = torch.nn.functional.cross_entropy
    train_fp32(model, loss, lambda: data, 5, 0.01, seed=0, progress=lambda *a: told.append(a))
    assert told == [("lr 0.01", done, 5) for done in range(6)]


def test_the_warm_start_tells_its_steps(tmp_path):
    from autoprec.data import load_dataset_for
    from autoprec.evaluate import Evaluator, EvaluatorConfig
    from autoprec.models import load_model

    spec = load_model("tinycnn", num_classes=10)
    ev = Evaluator(
        spec,
        load_dataset_for(spec, "teacher"),
        "h100-sxm",
        cache_dir=tmp_path,
        config=EvaluatorConfig(warm_start_steps=3),
    )
    told = []
    ev.warm_start_state(lambda *a: told.append(a))
    assert told == [("lr 0.05", done, 3) for done in range(4)]
    ev.warm_start_state(lambda *a: told.append(a))  # loaded: nothing to tell
    assert len(told) == 4


def test_on_a_terminal_the_bar_shows_the_time_left_before_the_first_evaluation():
    import io

    from rich.console import Console

    from autoprec.cli.search_progress import Progress

    console = Console(file=io.StringIO(), force_terminal=True, width=140)
    with Progress(console, 3, lambda result: None, evaluation_s=600.0, at_once=2):
        pass  # drawn once at least, on leaving
    drawn = console.file.getvalue()  # 3 evaluations of 600 s, 2 at a time: 900 s
    assert "0/3" in drawn and re.search(r"about (15 min 0|14 min 5\d) s left", drawn), drawn
