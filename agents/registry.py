"""The agents by name (:data:`AGENTS`) and :func:`search`, which runs one of them.

The registry imports an agent's module only when that agent is asked for, so that a search
with ``random`` or ``tpe`` never loads the RL stack that ``ppo`` needs (gymnasium,
stable-baselines3).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from autoprec._values import BUDGET_RANGE
from autoprec.agents.base import Agent, BudgetSpent, Problem, SearchCallback, Session, StopSearch
from autoprec.agents.result import SearchResult

NAMES = ("ppo", "tpe", "nsga2", "random", "greedy", "baseline")


def agent_class(name: str) -> type[Agent]:
    """The class of the agent called ``name``, its module imported now.

    Raises:
        ValueError: an unknown agent.
    """
    if name == "ppo":
        from autoprec.agents.ppo import PPOAgent

        return PPOAgent
    if name in ("tpe", "nsga2"):
        from autoprec.agents.optuna_agents import NSGA2Agent, TPEAgent

        return TPEAgent if name == "tpe" else NSGA2Agent
    if name in ("random", "greedy", "baseline"):
        from autoprec.agents.simple import BaselineAgent, GreedyAgent, RandomAgent

        return {"random": RandomAgent, "greedy": GreedyAgent, "baseline": BaselineAgent}[name]
    raise ValueError(f"unknown agent {name!r}; expected one of {', '.join(NAMES)}")


def agent_options(cls: type[Agent]) -> list[str]:
    """The options an agent class takes: its own keyword parameters and, where it passes
    ``**kwargs`` on to its base class, the base's (its own first, each once)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]  # self
        names += [
            p.name
            for p in parameters
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in names
        ]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names


class _Registry(Mapping[str, type[Agent]]):
    """``{name: agent class}``, each class imported when it is looked up."""

    def __getitem__(self, name: str) -> type[Agent]:
        if name not in NAMES:
            raise KeyError(name)
        return agent_class(name)

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)

    def __len__(self) -> int:
        return len(NAMES)

    def __repr__(self) -> str:
        return f"AGENTS({', '.join(NAMES)})"


#: The agents by name; looking one up imports its module.
AGENTS: Mapping[str, type[Agent]] = _Registry()


def search(
    problem: Problem,
    budget: int,
    seed: int = 0,
    callbacks: Iterable[SearchCallback] = (),
    agent: str = "ppo",
    **agent_kwargs: Any,
) -> SearchResult:
    """Search precision policies for ``problem`` with ``agent``.

    Args:
        problem: what to search (:class:`~autoprec.agents.base.Problem`).
        budget: real (non-surrogate) evaluations allowed; a policy evaluated twice in one
            search counts once. Evaluations served from the evaluator's cache count too.
        seed: seeds the agent.
        callbacks: :class:`~autoprec.agents.base.SearchCallback` s, called after every trial.
        agent: one of :data:`AGENTS`.
        **agent_kwargs: the agent's options (see its class; every agent takes ``resume`` and
            ``name``).

    Returns:
        The :class:`~autoprec.agents.result.SearchResult`; partial, with ``stopped=True``, if
        a callback raised :class:`~autoprec.agents.base.StopSearch`.

    Raises:
        ValueError: an unknown agent, an option the agent does not take, or a budget below 1.
    """
    if agent not in NAMES:
        raise ValueError(f"unknown agent {agent!r}; expected one of {', '.join(NAMES)}")
    if (problem_text := BUDGET_RANGE.problem(budget)) is not None:
        raise ValueError(f"budget must be {problem_text}")
    cls = agent_class(agent)
    parameters = agent_options(cls)
    unknown = sorted(set(agent_kwargs) - set(parameters))
    if unknown:
        accepted = ", ".join(parameters) or "none"
        raise ValueError(f"agent {agent!r} takes no option(s) {unknown}; it takes: {accepted}")
    strategy = cls(**agent_kwargs)
    session = Session(problem, budget, seed, callbacks, agent)
    start = time.perf_counter()
    try:
        strategy.run(session)
    except BudgetSpent:
        pass
    except StopSearch:
        session.result.stopped = True
    finally:
        session.result.wall_time_s = time.perf_counter() - start
    return session.result
