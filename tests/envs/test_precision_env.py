"""PrecisionEnv: the Gymnasium and SB3 env checkers, registration, the factory by name, masks,
remapping, reward."""

from __future__ import annotations

import dataclasses
import math

import gymnasium
import numpy as np
import pytest

import autoprec.envs
from autoprec.envs import PrecisionEnv, make_env, make_env_by_name
from autoprec.envs.factory import named_workload
from autoprec.envs.precision_env import DEFAULT_PRECISIONS, STATIC_FEATURES
from autoprec.evaluate import EvaluatorConfig, Metrics
from autoprec.evaluate.reward import RewardConfig
from autoprec.precision import Precision

FAST = {"model": "tinycnn", "steps": 5, "warm_start_steps": 20}  # make_env_by_name's keywords
WORKLOAD = named_workload("tinycnn")  # and the same as make_env's configs
CONFIG = EvaluatorConfig(steps=5, warm_start_steps=20)
LAYERS = ("conv1", "conv2", "fc1", "fc2")  # tinycnn's tunable layers, in execution order


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))


def _masked_episode(env, rng):
    """Run one episode of random masked actions; check every observation against the Box."""
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    terminated, steps = False, 0
    while not terminated:
        mask = env.action_masks()
        action = int(rng.choice(np.flatnonzero(mask)))
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(obs)
        assert not truncated and not info["remapped"]
        steps += 1
    return steps, reward, info


def test_gymnasium_env_checker():
    from gymnasium.utils.env_checker import check_env

    check_env(make_env(WORKLOAD, CONFIG, target="h100-sxm"))


def test_sb3_env_checker():
    from stable_baselines3.common.env_checker import check_env

    check_env(make_env(WORKLOAD, CONFIG, target="h100-sxm"), warn=True)


def test_make_after_import_and_masked_random_episode():
    assert autoprec.envs.ENV_ID in gymnasium.registry
    autoprec.envs._register()  # a second registration is a no-op
    env = gymnasium.make("autoprec/PrecisionSearch-v0", target="h100-sxm", **FAST)
    inner = env.unwrapped
    assert isinstance(inner, PrecisionEnv)
    assert inner.layers == LAYERS
    n = len(DEFAULT_PRECISIONS)
    assert env.observation_space.shape == (len(STATIC_FEATURES) + 2 * n + 2,)
    # the first layer is a convolution: h100 runs four of its formats (no fp8 convolution
    # kernel, whichever fp8 recipe; no MX tensor cores)
    fp8_at = [i for i, p in enumerate(DEFAULT_PRECISIONS) if Precision(p).is_fp8]  # recipes
    mask = env.get_wrapper_attr("action_masks")().tolist()
    assert mask == [p in ("fp32", "tf32", "bf16", "fp16") for p in DEFAULT_PRECISIONS]  # no mxfp8
    # per layer, from the runnability table: fp8 (every recipe) only on fc1 (512 x 64; fc2's 10
    # outputs are not a multiple of 16, as torchao requires)
    fp8 = {name: [bool(m[i]) for i in fp8_at] for name, m in zip(LAYERS, inner._masks, strict=True)}
    assert fp8 == {
        "conv1": [False] * 3,
        "conv2": [False] * 3,
        "fc1": [True] * 3,
        "fc2": [False] * 3,
    }
    obs, _ = env.reset(seed=0)
    sens = obs[len(STATIC_FEATURES) : len(STATIC_FEATURES) + 5]
    table = inner.sensitivity
    assert sens[0] == 0.0  # fp32 is the reference
    # fp8 moves the first layer's gradient more than bf16, and bf16 more than tf32
    assert sens[4] > sens[2] > sens[1] >= 0
    assert inner._sensitivity.max() == pytest.approx(1.0)
    assert table.layers == LAYERS

    steps, reward, info = _masked_episode(inner, np.random.default_rng(0))
    assert steps == len(LAYERS)
    assert math.isfinite(reward)
    assert set(info["policy"]) == set(LAYERS)
    assert info["metrics"]["fidelity"] == "short" and info["metrics"]["steps"] == 5
    assert reward == pytest.approx(inner.reward(Metrics.from_dict(info["metrics"])))
    with pytest.raises(gymnasium.error.ResetNeeded):
        inner.step(0)


def test_a100_masks_fp8_and_remaps_to_the_next_wider():
    env = make_env(WORKLOAD, CONFIG, target="a100-40gb-sxm")
    fp8, fp16 = env.precisions.index("fp8"), env.precisions.index("fp16")
    obs, _ = env.reset(seed=1)
    mask = env.action_masks()
    assert mask.dtype == bool and not mask[fp8] and mask.sum() == 4
    obs, reward, terminated, _, info = env.step(fp8)
    assert info["remapped"] and (info["requested"], info["precision"]) == ("fp8", "fp16")
    previous = len(STATIC_FEATURES) + len(env.precisions)  # after the per-precision sensitivities
    assert obs[previous + fp16] == 1.0  # the previous action is the applied one
    for _ in LAYERS[1:]:
        obs, reward, terminated, _, info = env.step(fp8)
        assert env.observation_space.contains(obs)
    assert terminated and math.isfinite(reward)
    assert info["policy"] == dict.fromkeys(LAYERS, "fp16")
    assert info["remapped_layers"]["conv1"] == ["fp8", "fp16"]
    assert info["metrics"]["feasible"]


def test_masked_episode_on_a100_never_remaps():
    env = make_env(WORKLOAD, CONFIG, target="a100-40gb-sxm")
    _, reward, info = _masked_episode(env, np.random.default_rng(3))
    assert math.isfinite(reward) and "fp8" not in info["policy"].values()


def test_cost_so_far_grows_and_stays_in_bounds():
    env = make_env(WORKLOAD, CONFIG, target="h100-sxm")
    obs, _ = env.reset(seed=0)
    assert obs[-2:].tolist() == [0.0, 0.0]
    costs = []
    for _ in LAYERS[:-1]:
        obs, *_ = env.step(0)  # fp32 everywhere: the cost so far climbs towards 1
        costs.append(obs[-2])
    assert costs == sorted(costs) and 0 < costs[-1] < 1


def test_reward_formula():
    env = make_env(WORKLOAD, CONFIG, RewardConfig(tolerance=0.05), target="h100-sxm")
    quality = {"accuracy": 0.9, "loss": 0.5, "fp32_accuracy": 0.9, "fp32_loss": 0.5}
    deltas = {"accuracy_delta": 0.0, "loss_delta": 0.01, "step_time_s": 1.0, "memory_bytes": 1}
    cost = {"speedup": 2.0, "memory_ratio": 0.5, "speedup_vs_amp": 1.0, "memory_ratio_vs_amp": 1}
    base = Metrics(**quality, **deltas, **cost, source="model")
    assert env.reward == RewardConfig(tolerance=0.05)
    w = env.reward.weights
    expected = w["speedup"] * math.log(2) + w["memory"] * math.log(2) - w["accuracy"] * 0.01
    assert env.reward(base) == pytest.approx(expected)
    over = dataclasses.replace(base, loss_delta=0.15)
    expected_over = (
        w["speedup"] * math.log(2) + w["memory"] * math.log(2) - w["accuracy"] * 0.15
    ) - (1 + 10 * 0.10)
    assert env.reward(over) == pytest.approx(expected_over)
    assert env.reward(dataclasses.replace(base, diverged=True)) == -5.0
    assert env.reward(dataclasses.replace(base, feasible=False)) == -5.0


def test_budget_mode_lowers_only_when_needed():
    met = make_env(WORKLOAD, CONFIG, target="h100-sxm", target_speedup=1e-3)
    met.reset(seed=0)
    for _ in LAYERS:
        *_, info = met.step(0)
    assert info["budget_lowered"] == [] and info["budget_met"]
    assert info["policy"] == dict.fromkeys(LAYERS, "fp32")

    unmet = make_env(WORKLOAD, CONFIG, target="h100-sxm", target_speedup=100.0)
    unmet.reset(seed=0)
    for _ in LAYERS:
        *_, info = unmet.step(0)
    assert not info["budget_met"]
    assert all(info["policy"][name] == "bf16" for name in info["budget_lowered"])


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="unknown precision"):
        make_env(WORKLOAD, CONFIG, precisions=("fp32", "bf8"))
    with pytest.raises(ValueError, match="unknown reward weight"):
        make_env_by_name(reward_weights={"speed": 1.0}, **FAST)
    with pytest.raises(ValueError, match="none of the precisions"):
        make_env(WORKLOAD, CONFIG, target="a100-40gb-sxm", precisions=("fp8",))
    env = make_env(WORKLOAD, CONFIG)
    env.reset()
    with pytest.raises(ValueError, match="action must be"):
        env.step(len(DEFAULT_PRECISIONS))


def test_make_vec_single_env_with_masks():
    from sb3_contrib.common.maskable.utils import get_action_masks, is_masking_supported
    from stable_baselines3.common.vec_env import DummyVecEnv

    from autoprec.envs.vec import make_vec

    venv = make_vec(1, seed=0, env_seed=3, target="a100-40gb-sxm", **FAST)
    assert isinstance(venv, DummyVecEnv) and is_masking_supported(venv)
    # the evaluator's seed is not shadowed by make_vec's own
    assert venv.envs[0].unwrapped.evaluate.__self__.seed == 3
    venv.reset()
    for _ in LAYERS:
        masks = get_action_masks(venv)
        n = len(DEFAULT_PRECISIONS)
        assert masks.shape == (1, n) and not masks[0, DEFAULT_PRECISIONS.index("fp8")]
        _, rewards, dones, infos = venv.step(np.array([2]))
    assert dones[0] and np.isfinite(rewards[0])
    assert infos[0]["policy"] == dict.fromkeys(LAYERS, "bf16") and "episode" in infos[0]
    venv.close()


@pytest.mark.slow
def test_make_vec_subprocess_two_envs():
    """Two spawned workers (about 6 s on 2 CPU cores, most of it importing torch)."""
    from stable_baselines3.common.vec_env import SubprocVecEnv

    from autoprec.envs.vec import make_vec

    venv = make_vec(2, seed=0, target="h100-sxm", **FAST)
    try:
        assert isinstance(venv, SubprocVecEnv)
        venv.reset()
        for _ in LAYERS:
            masks = np.stack(venv.env_method("action_masks"))
            _, rewards, dones, infos = venv.step(masks.argmax(axis=1))
        assert dones.all() and np.isfinite(rewards).all()
        assert all(set(info["policy"]) == set(LAYERS) for info in infos)
    finally:
        venv.close()


def test_make_by_name_equals_the_constructor_on_the_evaluators_pieces():
    """``gymnasium.make`` by name and ``PrecisionEnv`` on a hand-built evaluator's table,
    sensitivities and masks play the same episodes (the same observations and rewards)."""
    from autoprec.data import load_dataset_for
    from autoprec.defaults import DEFAULT_DATASET
    from autoprec.evaluate import Evaluator, EvaluatorConfig
    from autoprec.hardware.runnability import runnable_precisions
    from autoprec.models import load_model

    spec = load_model("tinycnn", num_classes=10)
    data = load_dataset_for(spec, DEFAULT_DATASET, seed=0)
    evaluator = Evaluator(
        spec, data, "h100-sxm", config=EvaluatorConfig(steps=5, warm_start_steps=20, seed=0)
    )
    table = evaluator.cost_table()
    # the sensitivities of the precisions offered, as make_env (and a Problem) has them graded
    evaluator.grade(p for p in DEFAULT_PRECISIONS if evaluator.device.supports(p))
    direct = PrecisionEnv(
        evaluator.evaluate,
        table,
        evaluator.surrogate().table,
        evaluator.device,
        RewardConfig({"memory": 1.0}, tolerance=0.01),
        choices=runnable_precisions(table, evaluator.device, DEFAULT_PRECISIONS),
    )
    named = gymnasium.make(
        autoprec.envs.ENV_ID,
        target="h100-sxm",
        reward_weights={"memory": 1.0},
        accuracy_tolerance=0.01,
        **FAST,
    ).unwrapped
    assert named.layers == direct.layers == LAYERS
    assert (named._masks == direct._masks).all()
    for actions in ([0, 0, 0, 0], [2, 3, 4, 2], [1, 2, 2, 3]):
        obs = [env.reset(seed=0)[0] for env in (named, direct)]
        assert np.array_equal(*obs)
        for action in actions:
            steps = [env.step(action) for env in (named, direct)]
            (obs_a, r_a, *_, info_a), (obs_b, r_b, *_, info_b) = steps
            assert np.array_equal(obs_a, obs_b) and r_a == r_b
            assert info_a.get("policy") == info_b.get("policy")
        assert info_a["metrics"] == info_b["metrics"]


def test_the_keywords_by_name_make_the_same_configs_as_the_typed_factory(tmp_path):
    """``make_env_by_name`` maps its keywords onto the workload and the evaluator's config:
    the same evaluator (settings key) as ``make_env`` given those configs; the evaluator's
    own keywords reach it (batch size, cache folder)."""
    typed = make_env(WORKLOAD, CONFIG).evaluate.__self__
    named = make_env_by_name(**FAST).evaluate.__self__
    assert named.config == typed.config and named.settings_key == typed.settings_key
    other = make_env_by_name(
        seed=1, evaluator_kwargs={"batch_size": 16, "cache_dir": tmp_path / "c"}, **FAST
    ).evaluate.__self__
    assert other.config == EvaluatorConfig(steps=5, warm_start_steps=20, batch_size=16, seed=1)
    assert other.cache_dir == tmp_path / "c" and other.data.key != typed.data.key


def test_choices_that_leave_a_layer_nothing_raise():
    env = make_env(WORKLOAD, CONFIG)
    with pytest.raises(ValueError, match="layer 'conv1' may take none of the precisions fp32"):
        PrecisionEnv(
            env.evaluate,
            env.table,
            env.sensitivity,
            env.device,
            precisions=("fp32",),
            choices={name: ("bf16",) for name in LAYERS},
        )


def test_the_environment_s_surrogate_grades_the_precisions_it_offers():
    """A standalone environment (and each of PPO's worker environments) prices a block format's
    loss from its own column, as the search's Problem does; not at 0 for want of one."""
    env = make_env(WORKLOAD, CONFIG, target="b200", precisions=("fp32", "bf16", "nvfp4"))
    table = env.unwrapped.sensitivity
    assert table.precisions == ("fp32", "bf16", "nvfp4")
    assert table.entry("fc1", "nvfp4") is not None  # fc2's 10 outputs cannot run nvfp4
