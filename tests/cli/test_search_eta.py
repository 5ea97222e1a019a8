"""`autoprec search` says how long the whole search has left (issue 39, item 3): on each phase's
line, on the plain progress and heartbeat lines off a terminal, and in rich's bars on one."""

from __future__ import annotations

import io
import re
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

import autoprec.cli.search_progress as progress
import autoprec.cli.sensitivity_progress as stages
from autoprec.cli import main
from autoprec.cli.search import ConsoleCallbacks
from autoprec.pipeline.eta import Remaining


@pytest.fixture(autouse=True)
def _private(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)


def _plain() -> Console:
    return Console(file=io.StringIO(), width=200)


def _remaining(seconds: float | None, *unknown: str) -> Remaining:
    """An estimate at a standing clock: ``seconds`` of a known part (None: none), and the
    ``unknown`` parts."""
    remaining = Remaining(clock=lambda: 0.0)
    remaining.expect("known", *unknown)
    if seconds is None:
        remaining.end("known")
    else:
        remaining.predict("known", seconds)
    return remaining


def test_the_words_say_about_at_least_or_nothing():
    assert progress.in_all(None) == ""
    assert progress.in_all(_remaining(65.0)) == "about 1 min 5 s left in all"
    assert progress.in_all(_remaining(65.0, "sensitivity")) == "at least 1 min 5 s left in all"
    assert progress.in_all(_remaining(None, "sensitivity")) == ""  # nothing known: nothing said
    assert progress.in_all(_remaining(0.3, "sensitivity")) == ""  # "at least 0 s" says nothing
    assert progress.in_all(_remaining(0.3)) == "about 0 s left in all"
    assert progress.also(lambda: "x") == ", x" and progress.also(lambda: "") == ""


def test_each_phase_line_ends_with_the_time_left_in_all():
    told = ConsoleCallbacks()
    told.console = _plain()
    told.phase_done("model and data", 1.25)  # before the search tells its estimate
    told.remaining(_remaining(130.0, "sensitivity"))
    told.phase_done("warm start and fp32 reference", 3.0)
    assert told.console.file.getvalue().splitlines() == [
        "model and data: 1.2 s",
        "warm start and fp32 reference: 3.0 s, at least 2 min 10 s left in all",
    ]


def test_off_a_terminal_progress_and_heartbeat_lines_say_it(monkeypatch):
    told = ConsoleCallbacks()
    told.console = console = _plain()
    told.remaining(_remaining(42.0))
    monkeypatch.setattr(stages, "PROGRESS_EVERY_S", 3600.0)
    with told.stage_progress("sensitivity") as (report, _):
        report("sweep", 0, 10)
    assert "sensitivity: sweep: 0/10 (0 s, about 42 s left in all)" in console.file.getvalue()

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.01)
    with told.working("fp32 reference"):
        deadline = time.monotonic() + 20
        while "still working" not in console.file.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert re.search(r"fp32 reference: still working \(\d+ s, about 42 s left in all\)",
                     console.file.getvalue())  # fmt: skip

    with told.search_progress(3, 60.0, 1) as (bar,):
        assert bar.running_line().endswith("about 3 min 0 s left, about 42 s left in all)")
        trial = SimpleNamespace(real=True)
        bar.on_trial(trial, SimpleNamespace(real_trials=[trial], best=None))
    assert ", about 42 s left in all) · surrogate episodes 0" in console.file.getvalue()


def test_on_a_terminal_the_bars_and_the_spinner_show_it():
    told = ConsoleCallbacks()
    told.console = console = Console(file=io.StringIO(), force_terminal=True, width=200)
    told.remaining(_remaining(600.0, "measured finalists"))
    with told.search_progress(3, 60.0, 1):
        pass  # drawn once at least, on leaving
    assert "(at least 10 min 0 s left in all)" in console.file.getvalue()
    told.console = console = Console(file=io.StringIO(), force_terminal=True, width=200)
    with told.stage_progress("sensitivity") as (report, _):
        report("sweep", 5, 10)  # drawn on leaving, before the transient bar is cleared
    assert "(at least 10 min 0 s left in all)" in console.file.getvalue()
    told.console = console = Console(file=io.StringIO(), force_terminal=True, width=200)
    with told.working("AMP comparison"):
        pass
    assert "... (at least 10 min 0 s left in all)" in console.file.getvalue()


def test_a_search_off_a_terminal_tells_the_time_left_in_all(capsys):
    argv = ["search", "--model", "mlp", "--agent", "random", "--budget", "2", "--no-mlflow"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    phases = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^([a-zA-Z0-9 ]+): \d+\.\d s(.*)$", err, re.MULTILINE)
    }
    assert phases["model and data"] == ""  # before the phases to come are known
    # a floor (the sensitivity unknown), unless it is under a second: then nothing
    assert re.fullmatch(
        r"(, at least [1-9]\d* s left in all)?", phases["warm start and fp32 reference"]
    )
    assert re.fullmatch(r", about \d+ s left in all", phases["sensitivity"])
    assert phases["hand rules"] == ", about 0 s left in all"  # the last counted: nothing left
    assert re.search(r"search: 1/2 evaluations \(.*, about \d+ s left in all\) · ", err)
    # the final table stays as it was
    assert re.search(r"^phases: model and data \d+ s, ", err, re.MULTILINE)
    assert "left in all" not in err[err.index("phases: ") :]
