"""What ``autoprec search`` shows while it works: each phase, and the search's evaluations.

On a terminal (stderr) rich draws a spinner per phase and a live bar for the search
(evaluations of the budget, elapsed, time left, best so far). Elsewhere (output to a file, CI)
rich would draw nothing until the end, so plain lines are printed instead: a search line as
each real evaluation finishes, and while one runs a line at most every :data:`HEARTBEAT_S`
seconds saying which evaluation of how many is running, for how long, and about how long the
rest will take (:func:`~autoprec.pipeline.eta.search_time_left`: the pace of the evaluations so
far; before the first, the fp32 reference run's time). A phase that runs long says it is still
working at the same rate. Given the whole search's estimate (:func:`in_all`), the spinners, the
bar and the lines also say how long the search has left in all. The library only reports
(search callbacks, ``progress`` callables, :class:`~autoprec.pipeline.eta.Remaining`); the
lines are made here.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from autoprec.pipeline.eta import search_time_left

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.progress import Task

    from autoprec.agents.result import SearchResult, Trial
    from autoprec.pipeline.eta import Remaining

#: Without a terminal, a line at least this often (seconds) while a phase or evaluation runs.
HEARTBEAT_S = 30.0


def console() -> Console:
    """The console the search prints to (stderr; stdout stays free for data)."""
    from rich.console import Console

    return Console(stderr=True)


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def in_all(remaining: Remaining | None) -> str:
    """``about 3 min 5 s left in all`` (``at least ...`` while a part's time is unknown or
    only a floor), or ``""`` while nothing is known (a floor under half a second included:
    ``at least 0 s`` says nothing)."""
    estimate = None if remaining is None else remaining.estimate()
    if estimate is None or (not estimate.known and estimate.seconds < 0.5):
        return ""
    return f"{'about' if estimate.known else 'at least'} {duration(estimate.seconds)} left in all"


def _said(whole: Callable[[], str] | None) -> str:
    """``whole()``, or ``""`` without one."""
    return "" if whole is None else whole()


def also(whole: Callable[[], str] | None) -> str:
    """``, <whole()>`` to end a line's parenthesis with, or ``""`` when it says nothing."""
    text = _said(whole)
    return f", {text}" if text else ""


def whole_column(whole: Callable[[], str] | None) -> Any:
    """A column of rich's progress bars that shows ``(<whole()>)`` when it says something."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Whole(ProgressColumn):
        def render(self, task: Task) -> Text:
            text = _said(whole)
            return Text(f"({text})" if text else "")

    return Whole()


@contextlib.contextmanager
def heartbeat(
    console: Console, line: Callable[[], str], every: float | None = None
) -> Iterator[None]:
    """While the block runs, print ``line()`` on ``console`` every ``every`` seconds (default
    :data:`HEARTBEAT_S`) from a background thread; nothing for a block shorter than that."""
    from autoprec._periodic import every as periodically

    def beat() -> None:
        console.print(line(), highlight=False, soft_wrap=True, markup=False)

    with periodically(HEARTBEAT_S if every is None else every, beat, "autoprec-progress"):
        yield


@contextlib.contextmanager
def working(console: Console, what: str, whole: Callable[[], str] | None = None) -> Iterator[None]:
    """A phase that draws no progress of its own: rich's spinner on a terminal, else a line
    ``<what>: still working (N s)`` every :data:`HEARTBEAT_S` seconds; both also say
    ``whole()`` (e.g. :func:`in_all`'s words) when it says something."""
    if console.is_terminal:
        from rich.text import Text

        class Status:  # rendered afresh at every refresh of the spinner
            def __rich__(self) -> Text:
                text = _said(whole)
                return Text.from_markup(f"[bold]{what}[/] ...") + (f" ({text})" if text else "")

        with console.status(Status()):
            yield
        return
    begin = time.perf_counter()
    with heartbeat(
        console,
        lambda: f"{what}: still working ({duration(time.perf_counter() - begin)}{also(whole)})",
    ):
        yield


class Progress:
    """The progress of one search's evaluations, updated by every trial (a search callback).

    Args:
        console: where it is drawn (a live bar on a terminal, else plain lines).
        budget: the real evaluations of the search.
        on_result: called with the newest result at every trial (what an interrupted search
            exports).
        evaluation_s: the expected seconds of one evaluation before any finished (the fp32
            reference run's), for the time left; None: unknown until the first.
        at_once: evaluations run side by side (the worker processes), 1 without.
        whole: the whole search's time left in words (:func:`in_all`), shown beside the
            search's own (None: not shown).
    """

    def __init__(
        self,
        console: Console,
        budget: int,
        on_result: Callable[[SearchResult], None],
        evaluation_s: float | None = None,
        at_once: int = 1,
        whole: Callable[[], str] | None = None,
    ) -> None:
        self.console = console
        self.whole = whole
        self.budget = budget
        self.on_result = on_result
        self.evaluation_s = evaluation_s
        self.at_once = max(1, at_once)
        self.surrogate = 0
        self.done = 0
        self.start = self.last = time.perf_counter()  # the search's start, the last evaluation's
        self._live: Any = None
        self._beat: Any = None
        if console.is_terminal:
            self._live = _bar(console, self)
            self.task = self._live.add_task("search", total=budget, best="")

    def __enter__(self) -> Progress:
        self.start = self.last = time.perf_counter()
        if self._live is not None:
            self._live.__enter__()
        else:
            self._beat = heartbeat(self.console, self.running_line)
            self._beat.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        elif self._beat is not None:
            self._beat.__exit__(*exc)

    def time_left(self, now: float) -> float | None:
        """Seconds left for the evaluations not finished at ``now``
        (:func:`~autoprec.pipeline.eta.search_time_left`); None when nothing tells."""
        return search_time_left(
            self.budget,
            self.done,
            self.last - self.start,
            now - self.last,
            self.evaluation_s,
            self.at_once,
        )

    def running_line(self) -> str:
        """``search: evaluation 4 of 12 running for 45 s (search 3 min 5 s, about 6 min 0 s
        left, about 8 min 10 s left in all)``."""
        now = time.perf_counter()
        left = self.time_left(now)
        rest = "" if left is None else f", about {duration(left)} left"
        return (
            f"search: evaluation {min(self.done + 1, self.budget)} of {self.budget} running for "
            f"{duration(now - self.last)} (search {duration(now - self.start)}{rest}"
            f"{also(self.whole)})"
        )

    def on_trial(self, trial: Trial, result: SearchResult) -> None:
        from autoprec.cli.interrupt import raise_if_terminated

        self.on_result(result)
        raise_if_terminated()  # a SIGTERM whose KeyboardInterrupt a library swallowed
        if not trial.real:
            self.surrogate += 1
        done = len(result.real_trials)
        if done != self.done:
            self.done, self.last = done, time.perf_counter()
        best = _best(result, self.surrogate)
        if self._live is not None:
            self._live.update(self.task, completed=done, best=best)
        elif trial.real:
            now = time.perf_counter()
            left = self.time_left(now)
            rest = "" if left is None or done >= self.budget else f", about {duration(left)} left"
            self.console.print(
                f"search: {done}/{self.budget} evaluations ({duration(now - self.start)}{rest}"
                f"{also(self.whole)}) · {best}",
                highlight=False,
                soft_wrap=True,
                markup=False,
            )


def _bar(console: Console, owner: Progress) -> Any:
    """Rich's live bar of ``owner``: evaluations, elapsed, ``owner``'s time left, the whole
    search's, best."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as Bar
    from rich.text import Text

    class TimeLeft(ProgressColumn):
        def render(self, task: Task) -> Text:
            left = owner.time_left(time.perf_counter())
            done = task.completed >= owner.budget
            return Text("" if left is None or done else f"about {duration(left)} left")

    return Bar(
        TextColumn("[bold]search[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeLeft(),
        whole_column(owner.whole),
        TextColumn("{task.fields[best]}", markup=False),
        console=console,
        transient=False,
    )


def _best(result: SearchResult, surrogate: int) -> str:
    """``best reward 0.912 (speedup 1.52x, loss delta +0.0012) · surrogate episodes 3``."""
    text = f"surrogate episodes {surrogate}"
    best = result.best
    if best is None:
        return text
    m = best.metrics
    delta = m.loss_delta if math.isfinite(m.loss_delta) else float("nan")
    return (
        f"best reward {best.reward:.3f} (speedup {m.speedup:.2f}x, loss delta {delta:+.4f})"
        f" · {text}"
    )
