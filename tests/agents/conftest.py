"""Fixtures of the agent tests: a private cache, one thread, a small evaluator on tinycnn."""

from __future__ import annotations

import pytest
from tinycnn_fixtures import _env, _loaded, data, spec  # noqa: F401

SMALL = {"steps": 5, "warm_start_steps": 20}
TARGET = "a100-40gb-sxm"  # no fp8: checks that agents keep to what the target runs


@pytest.fixture
def make_problem(spec, data):  # noqa: F811 - the imported fixtures
    """``make_problem(target=..., **problem_kwargs)``: a Problem on a fresh small evaluator."""
    from autoprec.agents import Problem
    from autoprec.evaluate import Evaluator, EvaluatorConfig

    def make(target: str = TARGET, **kwargs):
        evaluator = Evaluator(spec, data, target, config=EvaluatorConfig(**SMALL))
        return Problem(evaluator, **kwargs)

    return make
