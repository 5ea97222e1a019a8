"""The estimate of a whole search's remaining time (issue 39, item 3): its arithmetic on a fake
clock, and what a real small search tells its callbacks as each phase ends."""

from __future__ import annotations

import contextlib
import doctest
from types import SimpleNamespace

import pytest
from search_helpers import Lines

import autoprec
from autoprec.pipeline import eta
from autoprec.pipeline.eta import Estimate, Remaining, search_time_left


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _remaining(*parts: str) -> tuple[Remaining, Clock]:
    clock = Clock()
    remaining = Remaining(clock)
    remaining.expect(*parts)
    return remaining, clock


def test_the_modules_example_holds():
    assert doctest.testmod(eta).failed == 0


def test_nothing_is_known_before_the_parts_or_while_every_part_is_unknown():
    remaining = Remaining(Clock())
    assert remaining.estimate() is None  # the parts to come are not known yet
    remaining.expect("warm start", "search")
    assert remaining.estimate() is None  # never a silent zero


def test_a_known_part_beside_an_unknown_one_is_only_a_floor():
    remaining, _ = _remaining("warm start", "fp32 reference")
    remaining.predict("warm start", 12.0)
    assert remaining.estimate() == Estimate(12.0, known=False)
    remaining.end("fp32 reference")  # it ended: nothing unknown is left
    assert remaining.estimate() == Estimate(12.0, known=True)


def test_the_warm_start_is_predicted_from_the_pace_of_its_steps():
    remaining, clock = _remaining("warm start", "sensitivity")
    told = []
    progress = remaining.steps("warm start", lambda *a: told.append(a))
    remaining.begin("warm start")
    progress("lr 0.05", 0, 200)
    assert remaining.estimate() is None  # no step yet: no pace
    clock.now = 2.0
    progress("lr 0.05", 50, 200)  # 50 steps in 2 s
    assert remaining.step_s == pytest.approx(0.04)
    assert remaining.estimate().seconds == pytest.approx(150 * 0.04)
    clock.now = 3.0  # it counts down between reports
    assert remaining.estimate().seconds == pytest.approx(150 * 0.04 - 1.0)
    clock.now = 4.0
    progress("lr 0.025 (retry 1 of 3)", 0, 200)  # a retry starts afresh at the last pace
    assert remaining.estimate().seconds == pytest.approx(200 * 0.04)
    clock.now = 5.0
    progress("lr 0.025 (retry 1 of 3)", 10, 200)  # now its own pace: 0.1 s a step
    assert remaining.estimate().seconds == pytest.approx(190 * 0.1)
    assert not remaining.estimate().known  # the sensitivity is still unknown
    assert told[0] == ("lr 0.05", 0, 200) and len(told) == 4  # each report handed on
    remaining.end("warm start")
    assert remaining.estimate() is None


def test_a_prediction_counts_down_from_the_parts_start_and_an_overrun_is_a_floor():
    remaining, clock = _remaining("AMP comparison", "hand rules")
    remaining.predict("AMP comparison", 10.0)
    remaining.predict("hand rules", 5.0)
    clock.now = 100.0
    assert remaining.estimate() == Estimate(15.0, known=True)  # not started: all of it left
    remaining.begin("AMP comparison")
    clock.now = 104.0
    assert remaining.estimate() == Estimate(11.0, known=True)
    clock.now = 120.0  # it runs past its prediction: nothing left of it, but not "about"
    assert remaining.estimate() == Estimate(5.0, known=False)
    remaining.end("AMP comparison")
    assert remaining.estimate() == Estimate(5.0, known=True)
    remaining.begin("hand rules")
    clock.now = 130.0
    assert remaining.estimate() is None  # overrun, the last part: nothing is known
    remaining.end("hand rules")
    assert remaining.estimate() == Estimate(0.0, known=True)  # the end: nothing left


def test_the_sensitivity_is_the_plans_prediction_from_when_it_was_made():
    remaining, clock = _remaining("sensitivity")
    seen = []
    remaining.begin("sensitivity")
    clock.now = 3.0  # the warm-up and the reference pass before the plan
    remaining.plan("sensitivity", seen.append)(SimpleNamespace(predicted_s=35.0))
    assert remaining.estimate() == Estimate(35.0, known=True) and len(seen) == 1
    clock.now = 13.0
    assert remaining.estimate() == Estimate(25.0, known=True)


def test_comparisons_handed_to_the_workers_count_down_one_after_the_other():
    remaining, clock = _remaining("AMP comparison", "hand rules")
    remaining.predict("AMP comparison", 4.0)
    remaining.predict("hand rules", 8.0)
    remaining.queue("AMP comparison", "hand rules")  # the workers start them now
    clock.now = 3.0
    assert remaining.estimate() == Estimate(1.0 + 8.0, known=True)
    clock.now = 6.0
    # AMP done (the workers do not say when: no overrun seen), 2 s into the rules
    assert remaining.estimate() == Estimate(6.0, known=True)
    remaining.end("AMP comparison")
    remaining.begin("hand rules")  # the phase that waits for them: counting from before
    assert remaining.estimate() == Estimate(6.0, known=True)
    clock.now = 20.0  # waited for past the prediction: nothing is known
    assert remaining.estimate() is None


@pytest.mark.parametrize(
    ("budget", "done", "elapsed", "running", "evaluation_s", "at_once", "left"),
    [
        (3, 0, 0.0, 0.0, 60.0, 1, 180.0),  # before the first: the reference's time each
        (3, 0, 0.0, 100.0, 60.0, 1, 120.0),  # at least the two after the running one
        (4, 0, 0.0, 0.0, 10.0, 2, 20.0),  # two at a time
        (4, 2, 30.0, 5.0, 10.0, 2, 25.0),  # the pace so far (15 s), less the running 5 s
        (4, 2, 30.0, 40.0, 10.0, 2, 15.0),  # ... but one evaluation's pace at least
        (4, 4, 30.0, 5.0, 10.0, 2, 0.0),  # all done
        (4, 0, 0.0, 0.0, None, 1, None),  # nothing tells
    ],
)
def test_the_search_part_is_the_search_bars_arithmetic(
    budget, done, elapsed, running, evaluation_s, at_once, left
):
    assert search_time_left(budget, done, elapsed, running, evaluation_s, at_once) == left


def test_the_search_is_predicted_before_it_starts_and_paced_by_its_evaluations():
    remaining, clock = _remaining("search")
    remaining.expect_search(budget=4, evaluation_s=10.0, at_once=2)
    clock.now = 50.0
    assert remaining.estimate() == Estimate(20.0, known=True)  # not started: no countdown
    remaining.begin("search")
    clock.now = 53.0
    assert remaining.estimate().seconds == pytest.approx(17.0)
    clock.now = 62.0
    remaining.evaluated(1)  # 12 s an evaluation, the agent's time included
    assert remaining.estimate().seconds == pytest.approx(36.0)
    remaining.evaluated(1)  # the same count again (a surrogate trial): nothing new
    clock.now = 70.0
    assert remaining.estimate() == Estimate(pytest.approx(28.0), known=True)
    clock.now = 90.0  # the running one takes longer than the pace: at least the two after it
    assert remaining.estimate() == Estimate(pytest.approx(24.0), known=False)


def test_a_search_paced_by_a_run_on_every_thread_is_a_floor_until_its_first_evaluation():
    """With workers, the fp32 reference ran on every thread and the search's runs share
    them: its time is only a floor of an evaluation's until the search's own pace is known."""
    remaining, clock = _remaining("search")
    remaining.expect_search(budget=4, evaluation_s=10.0, at_once=2, at_least=True)
    assert remaining.estimate() == Estimate(20.0, known=False)
    remaining.begin("search")
    clock.now = 15.0
    remaining.evaluated(1)
    assert remaining.estimate() == Estimate(pytest.approx(45.0), known=True)


def test_the_verification_is_at_least_its_steps_at_the_warm_starts_pace():
    remaining, clock = _remaining("verification")
    remaining.expect_steps("verification", 300)
    assert remaining.estimate() is None  # no warm start trained: no pace to price it
    progress = remaining.steps("warm start")
    progress("lr 0.05", 0, 100)
    clock.now = 1.0
    progress("lr 0.05", 100, 100)
    remaining.expect_steps("verification", 300)
    assert remaining.estimate() == Estimate(pytest.approx(3.0), known=False)


class Estimates(Lines):
    """The estimate at each phase's end, and what the search bar was told."""

    def __init__(self) -> None:
        super().__init__()
        self.told: Remaining | None = None
        self.at_end: list[tuple[str, Estimate | None]] = []
        self.search: tuple[int, float | None, int] | None = None

    def remaining(self, remaining: Remaining) -> None:
        self.told = remaining

    def phase_done(self, name: str, seconds: float) -> None:
        super().phase_done(name, seconds)
        self.at_end.append((name, self.told.estimate()))

    @contextlib.contextmanager
    def search_progress(self, budget, evaluation_s, at_once):
        self.search = (budget, evaluation_s, at_once)
        self.at_search = self.told.estimate()
        yield []


def test_a_small_search_tells_the_time_left_at_each_phases_end():
    told = Estimates()
    report = autoprec.search(
        autoprec.SearchConfig(model="mlp", agent="random", budget=2, mlflow=False, out="p.yaml"),
        told,
    )
    ends = dict(told.at_end)
    assert told.at_end[0] == ("model and data", None)  # the phases to come are not known yet
    budget, one, at_once = told.search
    assert budget == 2 and one is not None and one > 0
    # the warm start's end: the search, AMP and the hand rules at the fp32 reference's time;
    # the sensitivity still unknown, so only a floor
    after_warm_start = ends["warm start and fp32 reference"]
    evaluations = budget + 1 + len(report.rules)
    assert after_warm_start == Estimate(pytest.approx(evaluations * one / at_once), known=False)
    assert ends["sensitivity"].known  # the plan's prediction: every part known now
    # the search's start: the same evaluations (the search's clock just started), all known
    expected = pytest.approx(evaluations * one / at_once, abs=0.05)
    assert told.at_search == Estimate(expected, known=True)
    for name, estimate in told.at_end[1:]:
        assert estimate is not None, name
    assert told.at_end[-1][1] == Estimate(0.0, known=True)  # the end: nothing left
