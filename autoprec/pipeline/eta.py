"""``Remaining``: how long a whole search has left, estimated while it runs.

The search (:mod:`autoprec.pipeline.run`) names the parts still to come and predicts each as soon
as something tells, and each part's prediction gives way to nothing left when it ends:

- **warm start**: the pace of its steps so far (when it trains; loaded from the cache it ends at
  once);
- **fp32 reference**: unknown until it ends (it is the first evaluation: nothing times one
  before it);
- **sensitivity**: the :class:`~autoprec.sensitivities.budget.SensitivityPlan`'s predicted
  seconds once planned (a cached table ends at once);
- **search**: the evaluations not finished at the pace of those so far, before the first at
  the fp32 reference's time (:func:`search_time_left`, the search bar's own estimate);
- **AMP comparison**, **hand rules**: one evaluation each at the search's first pace; with
  worker processes they start before the sensitivities are measured (:meth:`Remaining.queue`)
  and count down from then, one after the other;
- **per-layer timings**, **measured finalists** (a measured search): unknown until they end;
- **verification**: at least its training steps at the warm start's pace (fp32's; the emulated
  arms step slower, and each run also validates); unknown when the warm start was loaded.

MLflow's bookkeeping and the export are left out (they write files). While any part is unknown,
only a floor, or running past its prediction (nothing left of it, yet not ended), the estimate
is a floor (:attr:`Estimate.known` False); before anything is known it is None, never a silent
zero.

Example:
    >>> remaining = Remaining(clock=lambda: 0.0)
    >>> remaining.expect("sensitivity", "search")
    >>> remaining.estimate() is None  # nothing known yet
    True
    >>> remaining.expect_search(budget=4, evaluation_s=10.0, at_once=2)
    >>> remaining.estimate()
    Estimate(seconds=20.0, known=False)
    >>> remaining.predict("sensitivity", 5.0)
    >>> remaining.estimate()
    Estimate(seconds=25.0, known=True)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from autoprec._periodic import Progress
    from autoprec.sensitivities.budget import SensitivityPlan


@dataclass(frozen=True)
class Estimate:
    """The time a search has left.

    Attributes:
        seconds: the seconds left of the parts that have a prediction.
        known: every part still to come has one, none is only a floor and none runs past
            it; False: at least ``seconds`` are left.
    """

    seconds: float
    known: bool


def search_time_left(
    budget: int,
    done: int,
    elapsed: float,
    running: float,
    evaluation_s: float | None,
    at_once: int = 1,
) -> float | None:
    """Seconds left for a search's ``budget - done`` evaluations, or None when nothing tells.

    The pace is that of the ``done`` so far (``elapsed``: from the search's start to the end of
    the last one; wall-clock, so it holds the agent's own time between evaluations), before the
    first ``evaluation_s / at_once``. The ``running`` seconds since the last one ended are taken
    off, but what is left is at least the pace of the evaluations after the running one.
    """
    pace = _pace(done, elapsed, evaluation_s, at_once)
    if pace is None:
        return None
    left = budget - done
    return max(pace * (left - 1), pace * left - running, 0.0)


def _pace(done: int, elapsed: float, evaluation_s: float | None, at_once: int) -> float | None:
    """The seconds of one of a search's evaluations (see :func:`search_time_left`)."""
    if done:
        return elapsed / done
    if evaluation_s is not None:
        return evaluation_s / max(1, at_once)
    return None


@dataclass
class _Part:
    """One part still to come: its predicted seconds (None: unknown) as of ``since``, the
    later of its prediction and its start (None: not started, the whole of it left; a start
    still to come leaves the whole of it too)."""

    seconds: float | None = None
    since: float | None = None
    at_least: bool = False
    queued: bool = False  # run elsewhere (:meth:`Remaining.queue`): an overrun is not seen

    def left(self, now: float) -> float | None:
        if self.seconds is None:
            return None
        if self.since is None:
            return self.seconds
        return max(self.seconds - max(now - self.since, 0.0), 0.0)

    def overrun(self, now: float) -> bool:
        """Whether it runs past its prediction, as far as can be seen."""
        if self.queued or self.seconds is None or self.since is None:
            return False
        return now - self.since > self.seconds


@dataclass
class _Search(_Part):
    """The search's part: :func:`search_time_left` from its evaluations so far."""

    budget: int = 0
    evaluation_s: float | None = None
    at_once: int = 1
    done: int = 0
    last: float | None = None  # when the last evaluation ended

    def left(self, now: float) -> float | None:
        if self.since is None:  # not started: the whole budget
            return search_time_left(self.budget, 0, 0.0, 0.0, self.evaluation_s, self.at_once)
        last = self.since if self.last is None else self.last
        return search_time_left(
            self.budget, self.done, last - self.since, now - last, self.evaluation_s, self.at_once
        )

    def overrun(self, now: float) -> bool:
        """Whether the running evaluation has taken longer than the pace."""
        if self.since is None or self.done >= self.budget:
            return False
        last = self.since if self.last is None else self.last
        pace = _pace(self.done, last - self.since, self.evaluation_s, self.at_once)
        return pace is not None and now - last > pace


class Remaining:
    """The estimate of a whole search's remaining time, fed by the search as it runs and
    read at any time (from any thread) by whoever draws it (:meth:`estimate`).

    Args:
        clock: the time in seconds (``time.perf_counter``; a test's fake clock).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.step_s: float | None = None  # an fp32 training step's seconds, once a warm start ran
        self._parts: dict[str, _Part] | None = None  # None: the parts are not known yet
        self._lock = threading.Lock()

    def expect(self, *parts: str) -> None:
        """The parts still to come, each unknown until predicted."""
        with self._lock:
            self._parts = {name: _Part() for name in parts}

    def predict(self, part: str, seconds: float, *, at_least: bool = False) -> None:
        """``part`` has ``seconds`` left from now (from its start, if it has not started);
        ``at_least``: that is only a floor. Nothing for a part not expected."""
        with self._lock:
            found = (self._parts or {}).get(part)
            if found is not None:
                found.seconds, found.at_least = seconds, at_least
                if found.since is not None:
                    found.since = self.clock()

    def begin(self, part: str) -> None:
        """``part`` starts here: its prediction counts down from now (a queued one's from when
        it was queued, and now an overrun shows)."""
        with self._lock:
            found = (self._parts or {}).get(part)
            if found is not None:
                found.since = self.clock() if found.since is None else found.since
                found.queued = False

    def queue(self, *parts: str) -> None:
        """``parts`` start now one after the other, beside what the search does meanwhile (the
        evaluations handed to the worker processes ahead of the search's): each counts down
        from the predicted end of the one before (an unknown one is left as it is)."""
        with self._lock:
            start = self.clock()
            for name in parts:
                found = (self._parts or {}).get(name)
                if found is not None and found.seconds is not None and found.since is None:
                    found.since, found.queued = start, True
                    start += found.seconds

    def end(self, part: str) -> None:
        """``part`` ended: nothing is left of it (nothing for a part not expected)."""
        with self._lock:
            if self._parts is not None:
                self._parts.pop(part, None)

    def steps(self, part: str, then: Progress | None = None) -> Progress:
        """A ``progress(stage, done, total)`` for ``part``'s fp32 training steps that predicts
        its rest at the pace of its steps so far (a stage, such as a retry at a lower rate,
        starts afresh at the pace of the last), and hands each report on to ``then``."""
        begun: dict[str, tuple[int, float]] = {}  # the stage's first report: done, time

        def progress(stage: str, done: int, total: int) -> None:
            now = self.clock()
            first = begun.get(stage)
            if first is None or done <= first[0]:
                begun.clear()
                begun[stage] = (done, now)
            else:
                self.step_s = (now - first[1]) / (done - first[0])
            if self.step_s is not None:
                self.predict(part, self.step_s * (total - done))
            if then is not None:
                then(stage, done, total)

        return progress

    def expect_steps(self, part: str, steps: int) -> None:
        """``part`` trains at least ``steps`` steps at the fp32 pace :meth:`steps` measured
        (unknown when no warm start trained)."""
        if self.step_s is not None:
            self.predict(part, steps * self.step_s, at_least=True)

    def plan(
        self, part: str, then: Callable[[SensitivityPlan], None] | None = None
    ) -> Callable[[SensitivityPlan], None]:
        """An ``on_plan`` for a sensitivity table (``part``): predicts the plan's seconds, then
        hands the plan on to ``then``."""

        def on_plan(plan: SensitivityPlan) -> None:
            self.predict(part, plan.predicted_s)
            if then is not None:
                then(plan)

        return on_plan

    def expect_search(
        self, budget: int, evaluation_s: float | None, at_once: int = 1, *, at_least: bool = False
    ) -> None:
        """The part named ``search``: ``budget`` evaluations, ``evaluation_s`` seconds each
        expected before the first ends, ``at_once`` side by side (:func:`search_time_left`);
        ``at_least``: ``evaluation_s`` is only a floor (a run on every thread, where the
        search's run side by side on a share of them)."""
        with self._lock:
            if self._parts is not None and "search" in self._parts:
                self._parts["search"] = _Search(
                    since=self._parts["search"].since,
                    at_least=at_least,
                    budget=budget,
                    evaluation_s=evaluation_s,
                    at_once=at_once,
                )

    def evaluated(self, done: int) -> None:
        """``done`` of the search's evaluations have finished (a new count: one just ended)."""
        with self._lock:
            found = (self._parts or {}).get("search")
            if isinstance(found, _Search) and done != found.done:
                found.done, found.last = done, self.clock()
                found.at_least = False  # the pace is the search's own from now on

    def estimate(self, now: float | None = None) -> Estimate | None:
        """The time left at ``now`` (default: the clock's now); None while nothing is known
        (before the parts are expected, or while none known has time left)."""
        with self._lock:
            if self._parts is None:
                return None
            when = self.clock() if now is None else now
            lefts = [(p.left(when), p.at_least or p.overrun(when)) for p in self._parts.values()]
        seconds = sum(left for left, _ in lefts if left is not None)
        known = all(left is not None and not floor for left, floor in lefts)
        if not known and seconds <= 0.0:
            return None
        return Estimate(seconds, known)
