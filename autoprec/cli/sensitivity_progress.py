"""Progress of a sensitivity table on the command line (``analyze`` and ``search``).

:func:`sensitivity_progress` gives the two callbacks :func:`autoprec.graph.sensitivity` takes:
``on_plan`` prints the method chosen and why in one line, ``progress`` draws each stage (the
fp32 warm-up, the sweep, the Taylor estimate). Where stderr is a terminal that is rich's
transient bar; elsewhere (a log, CI) a plain line at each stage's start and then at most every
:data:`PROGRESS_EVERY_S` seconds, since rich draws nothing where it is not a terminal. Within a
search both also say how long the whole search has left (``whole``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from autoprec._periodic import Progress
from autoprec.cli.search_progress import also, whole_column

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from autoprec.sensitivities.budget import SensitivityPlan

#: Without a terminal, a progress line on stderr at most this often (seconds).
PROGRESS_EVERY_S = 5.0


class _Lines:
    """Plain progress lines on a console that is not a terminal."""

    def __init__(self, console: Console, whole: Callable[[], str] | None = None) -> None:
        self.console = console
        self.whole = whole
        self.stage = ""
        self.start = self.last = time.perf_counter()
        self.first, self.began = 0, self.start  # done and the time at the stage's start

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if stage != self.stage:
            self.stage, self.last, self.first, self.began = stage, now, done, now
            self._print(stage, done, total, now)
        elif now - self.last >= PROGRESS_EVERY_S or done == total:
            self.last = now
            self._print(stage, done, total, now)

    def _print(self, stage: str, done: int, total: int, now: float) -> None:
        took = now - self.start
        left = ""
        if 0 < total and self.first < done < total:  # the time left at the pace so far
            pace = (now - self.began) / (done - self.first)
            left = f", about {pace * (total - done):.0f} s left"
        line = f"{stage}: {done}/{total} ({took:.0f} s{left}{also(self.whole)})"
        self.console.print(line, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def sensitivity_progress(
    console: Console, what: str, whole: Callable[[], str] | None = None
) -> Iterator[tuple[Progress, Callable[[SensitivityPlan], None]]]:
    """``(progress, on_plan)`` for one sensitivity table, drawn on ``console`` (stderr).

    Args:
        console: a rich console (on stderr: stdout stays free for the results).
        what: the first words of every line, e.g. ``"sensitivity on teacher"``.
        whole: the whole search's time left in words
            (:func:`~autoprec.cli.search_progress.in_all`), shown after the stage's own (None:
            not shown).
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    def on_plan(plan: SensitivityPlan) -> None:
        console.print(f"{what}: {plan.describe()}", highlight=False, soft_wrap=True)

    if not console.is_terminal:
        lines = _Lines(console, whole)
        yield (lambda stage, done, total: lines(f"{what}: {stage}", done, total)), on_plan
        return
    columns = (
        "{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        whole_column(whole),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=None)

        def progress(stage: str, done: int, total: int) -> None:
            bar.update(task, description=f"{what}: {stage}", completed=done, total=total)

        yield progress, on_plan
