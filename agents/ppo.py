"""The ``ppo`` agent: sb3-contrib's MaskablePPO on :class:`~autoprec.envs.PrecisionEnv`.

PPO trains on the ``surrogate`` fidelity (milliseconds an episode); every training episode's
policy is recorded as a surrogate :class:`~autoprec.agents.Trial`. The real budget goes to the
best distinct policies PPO proposed, in ``rounds``: train, sample proposals from the current
PPO policy, evaluate the top ones for real (ranked by the surrogate, re-predicted), train more.
Each real evaluation refits the evaluator's surrogate, so later rounds train on a better
reward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoprec.agents.base import SURROGATE, Agent, Session, StopSearch

CHECKPOINT_NAME = "ppo_model.zip"
MAX_TIMESTEPS = 200_000


class _SurrogateView:
    """The problem's evaluator with the surrogate as its default fidelity (for the env)."""

    def __init__(self, session: Session) -> None:
        self._problem = session.problem
        self._evaluator = session.problem.evaluator

    def evaluate(self, policy: Any, fidelity: str | None = None) -> Any:
        if isinstance(policy, Mapping):
            policy = self._problem.to_policy(policy)
        return self._evaluator.evaluate(policy, fidelity or SURROGATE)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._evaluator, name)


def _callback_class() -> type:
    from stable_baselines3.common.callbacks import BaseCallback

    from autoprec.evaluate.metrics import Metrics

    class Collector(BaseCallback):
        """Records every finished episode as a surrogate trial; stops on StopSearch."""

        def __init__(self, session: Session) -> None:
            super().__init__()
            self.session = session
            self.stop: StopSearch | None = None

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", ()):
                if "policy" not in info or "metrics" not in info:
                    continue
                metrics = Metrics.from_dict(info["metrics"])
                try:
                    self.session.record_surrogate(
                        info["policy"], metrics, metrics.wall_time_s, phase="train"
                    )
                except StopSearch as exc:
                    self.stop = exc
                    return False
            return True

    return Collector


class PPOAgent(Agent):
    """MaskablePPO trained on the surrogate; the real budget is spent on its best proposals.

    Args:
        timesteps: PPO steps in all (one step per layer); None: ``layers x max(128, 32 x
            budget)``, at most 200 000.
        rounds: train/evaluate rounds the timesteps and the budget are split into.
        n_envs: environments; above 1, ``make_vec(n_envs, **problem.env_kwargs,
            fidelity="surrogate")`` runs them in worker processes (their surrogates are not
            refit by this process's real evaluations).
        n_steps: PPO rollout length per env; None: the smallest multiple of the layer count
            that is at least 64.
        proposals: stochastic episodes sampled from the PPO policy after each round (plus one
            deterministic); None: ``max(16, 2 x budget)``.
        checkpoint_dir: where the model is saved (``ppo_model.zip``) after each training phase
            and on a stop; a model found there is loaded and its training continued.
        ppo_kwargs: overrides of the ``MaskablePPO`` arguments (defaults: ``gamma=1.0``,
            ``ent_coef=0.01``, ``batch_size`` half a rollout, ``device="cpu"``).
        verbose: SB3's verbosity.
    """

    name = "ppo"

    def __init__(
        self,
        timesteps: int | None = None,
        rounds: int = 2,
        n_envs: int = 1,
        n_steps: int | None = None,
        proposals: int | None = None,
        checkpoint_dir: str | Path | None = None,
        ppo_kwargs: Mapping[str, Any] | None = None,
        verbose: int = 0,
    ) -> None:
        for what, value, low in (("rounds", rounds, 1), ("n_envs", n_envs, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
        if timesteps is not None and (not isinstance(timesteps, int) or timesteps < 1):
            raise ValueError(f"timesteps must be an integer >= 1 or None, got {timesteps!r}")
        self.timesteps = timesteps
        self.rounds = rounds
        self.n_envs = n_envs
        self.n_steps = n_steps
        self.proposals = proposals
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.ppo_kwargs = dict(ppo_kwargs or {})
        self.verbose = verbose

    @property
    def checkpoint_path(self) -> Path | None:
        """The model file in ``checkpoint_dir`` (None without one)."""
        return None if self.checkpoint_dir is None else self.checkpoint_dir / CHECKPOINT_NAME

    def run(self, session: Session) -> None:
        from autoprec.envs.precision_env import PrecisionEnv

        problem = session.problem
        n_layers = len(problem.layers())
        n_steps = self.n_steps or n_layers * math.ceil(64 / n_layers)
        total = self.timesteps or min(n_layers * max(128, 32 * session.budget), MAX_TIMESTEPS)
        proposals = self.proposals if self.proposals is not None else max(16, 2 * session.budget)
        view = _SurrogateView(session)
        env_args = {
            "precisions": problem.precisions,
            "reward_weights": problem.reward_weights,
            "accuracy_tolerance": problem.accuracy_tolerance,
        }
        sampler_env = PrecisionEnv(evaluator=view, **env_args)
        venv = self._make_venv(session, view, env_args)
        collector = _callback_class()(session)
        try:
            model = self._model(venv, session, n_steps)
            for r in range(self.rounds):
                target = total * (r + 1) // self.rounds
                if model.num_timesteps < target:
                    model.learn(
                        target - model.num_timesteps, callback=collector, reset_num_timesteps=False
                    )
                    self._save(model, session)
                    if collector.stop is not None:
                        raise collector.stop
                self._propose(model, sampler_env, session, proposals, r)
                share = math.ceil(session.remaining / (self.rounds - r))
                self._spend(session, share, r)
        except StopSearch:
            self._save(model, session)
            raise
        finally:
            venv.close()
        session.result.info["timesteps"] = int(model.num_timesteps)

    # --- pieces -------------------------------------------------------------------------------
    def _make_venv(self, session: Session, view: _SurrogateView, env_args: dict) -> Any:
        if self.n_envs == 1:
            from stable_baselines3.common.monitor import Monitor
            from stable_baselines3.common.vec_env import DummyVecEnv

            from autoprec.envs.precision_env import PrecisionEnv

            venv = DummyVecEnv([lambda: Monitor(PrecisionEnv(evaluator=view, **env_args))])
            venv.seed(session.seed)
            return venv
        from autoprec.envs.vec import make_vec

        kwargs = dict(session.problem.env_kwargs)
        if not kwargs:
            raise ValueError(
                "ppo with n_envs > 1 rebuilds the environment in worker processes and needs "
                "problem.env_kwargs (model, dataset, target, ...)"
            )
        evaluator_seed = kwargs.pop("seed", None)
        return make_vec(self.n_envs, seed=session.seed, env_seed=evaluator_seed, **kwargs)

    def _model(self, venv: Any, session: Session, n_steps: int) -> Any:
        from sb3_contrib import MaskablePPO

        path = self.checkpoint_path
        if path is not None and path.exists():
            model = MaskablePPO.load(path, env=venv, device="cpu")
            session.result.info["resumed_from"] = str(path)
            return model
        kwargs: dict[str, Any] = {
            "n_steps": n_steps,
            "batch_size": max(2, n_steps * self.n_envs // 2),
            "gamma": 1.0,
            "ent_coef": 0.01,
            "seed": session.seed,
            "device": "cpu",
            "verbose": self.verbose,
        }
        kwargs.update(self.ppo_kwargs)
        return MaskablePPO("MlpPolicy", venv, **kwargs)

    def _save(self, model: Any, session: Session) -> None:
        path = self.checkpoint_path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save(path)
        session.result.info["checkpoint"] = str(path)

    @staticmethod
    def _propose(model: Any, env: Any, session: Session, n: int, round_: int) -> None:
        """Sample ``n`` stochastic episodes and one deterministic one from the PPO policy."""
        from autoprec.evaluate.metrics import Metrics

        for i in range(n + 1):
            obs, _ = env.reset(seed=session.seed + i)
            terminated, info = False, {}
            while not terminated:
                action, _ = model.predict(
                    obs, action_masks=env.action_masks(), deterministic=(i == n)
                )
                obs, _, terminated, _, info = env.step(int(action))
            metrics = Metrics.from_dict(info["metrics"])
            session.record_surrogate(
                info["policy"],
                metrics,
                metrics.wall_time_s,
                phase="propose",
                round=round_,
                deterministic=i == n,
            )

    @staticmethod
    def _spend(session: Session, k: int, round_: int) -> None:
        """Evaluate for real the ``k`` best distinct proposals not evaluated yet."""
        if k <= 0:
            return
        problem = session.problem
        best: dict[tuple[str, ...], tuple[float, dict[str, str]]] = {}
        for trial in session.result.trials:
            if trial.real or session.seen(trial.policy) is not None:
                continue
            key = session.key(trial.policy)
            if key not in best or trial.reward > best[key][0]:
                best[key] = (trial.reward, trial.policy)
        # The surrogate may have been refit since: re-rank a shortlist with its predictions.
        shortlist = sorted(best.values(), key=lambda item: -item[0])[: max(8 * k, 64)]
        predicted = [problem.reward(problem.evaluate(p, SURROGATE)) for _, p in shortlist]
        order = sorted(range(len(shortlist)), key=lambda i: (-predicted[i], i))
        for i in order[:k]:
            if session.exhausted:
                return
            session.evaluate(shortlist[i][1], surrogate_reward=predicted[i], round=round_)
