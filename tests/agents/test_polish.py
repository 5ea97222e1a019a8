"""Coordinate ascent on the surrogate reward (agents/polish.py), on a problem whose reward is a
known sum over layers, so that the best policy is known."""

from __future__ import annotations

from types import SimpleNamespace

from autoprec.agents.polish import polish, polish_starts

GAIN = {"a": {"fp32": 0, "bf16": 2, "fp8": 1}, "b": {"fp32": 0, "bf16": 1, "fp8": 3}}


class _Problem:
    def __init__(self) -> None:
        self.calls = 0

    def layers(self) -> list[str]:
        return ["a", "b"]

    def choices(self, layer: str) -> list[str]:
        return ["fp32", "bf16", "fp8"]

    def complete(self, policy):
        return {n: policy.get(n, "fp32") for n in self.layers()}

    def evaluate(self, policy, fidelity):
        self.calls += 1
        return SimpleNamespace(score=sum(GAIN[n][p] for n, p in policy.items()))

    def reward(self, metrics) -> float:
        return float(metrics.score)


def test_polish_finds_each_layers_best_precision_from_any_start():
    problem = _Problem()
    for start in ({}, {"a": "fp8", "b": "fp32"}, {"a": "bf16", "b": "fp8"}):
        policy, metrics, reward = polish(problem, start)
        assert policy == {"a": "bf16", "b": "fp8"} and reward == 5 == metrics.score


def test_polish_stops_when_a_pass_changes_nothing():
    problem = _Problem()
    polish(problem, {"a": "bf16", "b": "fp8"})  # already best: one pass, 4 trials + the start
    assert problem.calls == 5


def test_the_starts_are_the_best_baseline_and_the_best_proposal_without_repeats():
    problem = _Problem()
    baselines = [{"a": "fp32", "b": "fp32"}, {"a": "fp32", "b": "fp8"}]
    assert polish_starts(problem, baselines, [{"a": "bf16", "b": "bf16"}]) == [
        {"a": "fp32", "b": "fp8"},
        {"a": "bf16", "b": "bf16"},
    ]
    assert polish_starts(problem, baselines, [{"a": "fp32", "b": "fp8"}]) == [
        {"a": "fp32", "b": "fp8"}
    ]
