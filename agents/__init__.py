"""Search agents: find per-layer training precisions for one model on one target.

Every agent searches a :class:`Problem` (an :class:`~autoprec.evaluate.Evaluator` and how its
metrics are scored) within a budget of real evaluations and returns a :class:`SearchResult`
(its trials, the best one, the Pareto front). The agents, by name (:data:`AGENTS`):

* ``ppo``: MaskablePPO on :class:`~autoprec.envs.PrecisionEnv`, trained on the surrogate;
  the budget goes to its best proposals;
* ``tpe``, ``nsga2``: Optuna samplers (single objective: the reward; multi-objective:
  loss_delta, speedup, memory_ratio), with optional RDB storage to resume or share a study;
* ``random``: a uniform random precision per layer;
* ``greedy``: sensitivity-ordered progressive lowering (also the migration tool);
* ``baseline``: fp32, AMP-bf16, AMP-fp16, the hardware's default rule and the hand-written
  low-precision rules (torchao's auto filter per recipe, fp8 except the output head, Megatron's
  first and last blocks in bf16, NVFP4 everywhere or with torchtitan's and Megatron's bf16
  blocks, DeepSeek-V3's fp8 block scaling, MXFP8 everywhere; :mod:`.hand_rules`).

Example:
    >>> from autoprec.agents import Problem, search
    >>> from autoprec.data import load_dataset_for
    >>> from autoprec.evaluate import Evaluator
    >>> from autoprec.models import load_model
    >>> spec = load_model("tinycnn", num_classes=10)
    >>> evaluator = Evaluator(spec, load_dataset_for(spec, "digits"), target="h100-sxm")
    >>> result = search(Problem(evaluator), budget=20, agent="tpe", seed=0)  # doctest: +SKIP
    >>> result.best.reward, result.best.policy  # doctest: +SKIP
    (0.41, {'conv1': 'tf32', 'conv2': 'bf16', 'fc1': 'bf16', 'fc2': 'fp32'})
    >>> policy = result.best_policy(spec)  # doctest: +SKIP

A callback sees every trial and may end the search (e.g. on SIGTERM)::

    class Stop:
        def on_trial(self, trial, result):
            if stop_requested:
                raise StopSearch

The agent modules import optuna and stable-baselines3 only when a search runs, and the ``ppo``
module itself only when it is asked for.
"""

from __future__ import annotations

from typing import Any

from autoprec.agents.base import Agent, Problem, SearchCallback, Session, StopSearch
from autoprec.agents.optuna_agents import NSGA2Agent, TPEAgent
from autoprec.agents.registry import AGENTS, search
from autoprec.agents.result import SearchResult, Trial
from autoprec.agents.simple import BaselineAgent, GreedyAgent, RandomAgent

__all__ = [
    "AGENTS",
    "Agent",
    "BaselineAgent",
    "GreedyAgent",
    "NSGA2Agent",
    "PPOAgent",
    "Problem",
    "RandomAgent",
    "SearchCallback",
    "SearchResult",
    "Session",
    "StopSearch",
    "TPEAgent",
    "Trial",
    "search",
]


def __getattr__(name: str) -> Any:
    """``PPOAgent``, imported when first asked for (it needs gymnasium and SB3 to run)."""
    if name == "PPOAgent":
        return AGENTS["ppo"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
