"""The progress line of ``autoprec search``: evaluations of the budget, ETA, best so far."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def console() -> Any:
    """The console the search prints to (stderr; stdout stays free for data)."""
    from rich.console import Console

    return Console(stderr=True)


class Progress:
    """A rich progress line for one search, updated by every trial (a search callback).

    Args:
        console: where it is drawn.
        budget: the real evaluations of the search (the bar's total).
        on_result: called with the newest result at every trial (what an interrupted search
            exports).
    """

    def __init__(self, console: Any, budget: int, on_result: Callable[[Any], None]) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self.on_result = on_result
        self.progress = Bar(
            TextColumn("[bold]search[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[best]}"),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("search", total=budget, best="")
        self.surrogate = 0

    def __enter__(self) -> Progress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def on_trial(self, trial: Any, result: Any) -> None:
        self.on_result(result)
        if not trial.real:
            self.surrogate += 1
        best = result.best
        text = f"surrogate episodes {self.surrogate}"
        if best is not None:
            m = best.metrics
            delta = m.loss_delta if math.isfinite(m.loss_delta) else float("nan")
            text = (
                f"best reward {best.reward:.3f} (speedup {m.speedup:.2f}x, loss delta "
                f"{delta:+.4f}) · {text}"
            )
        self.progress.update(self.task, completed=len(result.real_trials), best=text)
