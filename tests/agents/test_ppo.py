"""The ``ppo`` agent on models of any depth: its rollout never leaves a one-sample minibatch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoprec.agents import Problem, search
from autoprec.agents.ppo import rollout_sizes
from autoprec.models.spec import ModelSpec

LAYERS = [1, 2, 3, 5, 7, 13, 33, 70]


def mlp_spec(n_layers: int, width: int = 8) -> ModelSpec:
    """A user model of ``n_layers`` linear layers on 8x8 one-channel images."""
    dims = [64] + [width] * (n_layers - 1) + [10]
    layers: list[nn.Module] = [nn.Flatten()]
    for i in range(n_layers):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < n_layers - 1:
            layers.append(nn.ReLU())
    torch.manual_seed(0)
    module = nn.Sequential(*layers)
    return ModelSpec(f"mlp{n_layers}", module, (1, 8, 8), "image-classification", 10)


@pytest.mark.parametrize("n_envs", [1, 2, 3])
def test_default_rollouts_split_into_full_minibatches(n_envs):
    for n_layers in range(1, 201):
        n_steps, batch = rollout_sizes(n_layers, n_envs)
        rollout = n_steps * n_envs
        assert n_steps % n_layers == 0 and n_steps >= 64  # whole episodes
        assert rollout % batch == 0 and batch == rollout // 2, (n_layers, n_steps, batch)


def test_given_rollout_sizes_are_made_safe_or_refused():
    assert rollout_sizes(5, n_steps=65) == (65, 13)  # the largest divisor up to half
    assert rollout_sizes(5, n_steps=67) == (67, 67)  # prime: one minibatch of everything
    assert rollout_sizes(5, n_steps=65, batch_size=32, normalize_advantage=False) == (65, 32)
    with pytest.raises(ValueError, match="minibatch of one sample.*65 steps"):
        rollout_sizes(5, n_steps=65, batch_size=32)
    with pytest.raises(ValueError, match="minibatch of one sample"):
        rollout_sizes(1, n_steps=1)
    with pytest.raises(ValueError, match="n_steps must be"):
        search_agent_n_steps(0)


def search_agent_n_steps(n_steps):
    from autoprec.agents import PPOAgent

    return PPOAgent(n_steps=n_steps)


@pytest.mark.parametrize("n_layers", LAYERS)
def test_ppo_searches_models_of_any_depth(n_layers):
    """The issue's crash: an odd rollout (5 layers: 65 steps, minibatches of 32) left a last
    minibatch of one sample, whose normalised advantage was NaN, and sampling then failed."""
    from autoprec.data import load_dataset_for
    from autoprec.evaluate import Evaluator, EvaluatorConfig

    spec = mlp_spec(n_layers)
    data = load_dataset_for(spec, "digits", seed=0)
    evaluator = Evaluator(
        spec, data, "a100-40gb-sxm", config=EvaluatorConfig(steps=2, warm_start_steps=5)
    )
    problem = Problem(evaluator)
    assert len(problem.layers()) == n_layers
    budget = 2
    n_steps, _ = rollout_sizes(n_layers)  # the default rollout and minibatch sizes
    result = search(  # one rollout in each of the two rounds
        problem, budget=budget, seed=0, agent="ppo", timesteps=2 * n_steps, proposals=2
    )
    assert result.info["timesteps"] == 2 * n_steps
    assert len(result.real_trials) == budget
    assert all(math.isfinite(t.reward) for t in result.trials)
    assert result.best is not None


def test_ppo_keeps_its_state_under_the_search_name(make_problem, tmp_path):
    """Named, the agent owns ``cache_dir()/agents/<file-safe name>``: a new search empties it,
    ``resume=True`` goes on from the checkpoint there, ``checkpoint_dir`` wins over the name."""
    from autoprec.agents import PPOAgent
    from autoprec.cache import cache_dir

    folder = cache_dir() / "agents" / "my_study_1"
    assert PPOAgent(name="my study/1").checkpoint_dir == folder
    assert PPOAgent(name="x", checkpoint_dir=tmp_path / "own").checkpoint_dir == tmp_path / "own"
    assert PPOAgent().checkpoint_dir is None

    options = {"timesteps": 128, "proposals": 2, "name": "my study/1"}
    folder.mkdir(parents=True)
    (folder / "stale.txt").write_text("from an older search")
    first = search(make_problem(), budget=2, seed=0, agent="ppo", **options)
    assert not (folder / "stale.txt").exists() and (folder / "ppo_model.zip").exists()
    assert "resumed_from" not in first.info

    resumed = search(make_problem(), budget=2, seed=0, agent="ppo", resume=True, **options)
    assert resumed.info["resumed_from"] == str(folder / "ppo_model.zip")
    assert [t.policy for t in resumed.real_trials] == [t.policy for t in first.real_trials]

    again = search(make_problem(), budget=2, seed=0, agent="ppo", **options)
    assert "resumed_from" not in again.info  # not resumed: the folder was emptied first


def test_ppo_leaves_no_logger_folder_in_the_temp_directory(make_problem, tmp_path, monkeypatch):
    """SB3 makes ``SB3-<date>`` in the temp directory on every ``learn`` of a model without a
    logger of its own; a search makes none."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    search(make_problem(), budget=2, seed=0, agent="ppo", timesteps=128, proposals=2)
    assert not [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("SB3-")]
