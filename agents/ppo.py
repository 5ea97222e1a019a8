"""The ``ppo`` agent: sb3-contrib's MaskablePPO on :class:`~autoprec.envs.PrecisionEnv`.

PPO trains on the ``surrogate`` fidelity (milliseconds an episode); every training episode's
policy is recorded as a surrogate :class:`~autoprec.agents.Trial`. The real budget goes to the
best distinct policies PPO proposed, in ``rounds``: train, sample proposals from the current
PPO policy, polish the best of them and of the baselines (:mod:`autoprec.agents.polish`),
evaluate the top ones for real, train more. Each real evaluation refits the evaluator's
surrogate, so later rounds train on a better reward.

Given its seed and the real evaluations' results, the search is deterministic, and that is how
it resumes: each training and each proposal phase reseeds the generators SB3 draws from (from
the search's seed and the round), so that nothing the evaluator draws in between (a fresh
fine-tuning run, where a resumed search finds a cache hit) changes what PPO does. With a
checkpoint folder (``checkpoint_dir``, or the search's ``name``'s), the agent's state is saved at
the start and after each training phase (``ppo_model.zip``: the model and its optimiser;
``ppo_state.json``: the round, the pool of proposals and the real trials so far). A new search
with the same settings loads it, re-reads the real trials it lists (served by the evaluator's
cache, so that the surrogate is refit exactly as it was; they count against the budget but do
not call the callbacks again) and goes on from there; evaluations finished after the
checkpoint are found in the cache again. So an interrupted and resumed search spends its
budget once and ends where an uninterrupted one would. A checkpoint of other settings, an
older format or a damaged one is ignored (with a warning) and the search starts over, which
gives the same result, only later.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec.agents.base import SURROGATE, Agent, Problem, Session
from autoprec.agents.naming import state_folder
from autoprec.agents.polish import polished
from autoprec.agents.ppo_checkpoint import (
    CHECKPOINT_NAME,
    STATE_FORMAT,
    STATE_NAME,
    CheckpointError,
    in_the_way,
    mismatch,
    parse_state,
)
from autoprec.agents.ppo_sb3 import (
    Pool,
    add_to_pool,
    callback_class,
    logger_without_folder,
    rollout_sizes,
)

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.envs.precision_env import PrecisionEnv

_WHAT = "PPO checkpoint"  # as cache notes name it
MAX_TIMESTEPS = 200_000


def surrogate_env(problem: Problem) -> PrecisionEnv:
    """The environment of ``problem`` that PPO trains on: its layers, masks and reward, each
    episode's policy scored at the surrogate fidelity."""
    from autoprec.envs.precision_env import PrecisionEnv

    table = problem.table
    return PrecisionEnv(
        functools.partial(problem.evaluate, fidelity=SURROGATE),
        table,
        problem.evaluator.surrogate().table,
        problem.evaluator.device,
        problem.reward,
        problem.precisions,
        {layer: problem.choices(layer) for layer in table.names},
    )


class PPOAgent(Agent):
    """MaskablePPO trained on the surrogate; the real budget is spent on its best proposals.

    Args:
        timesteps: PPO steps in all (one step per layer); None: ``layers x max(128, 32 x
            budget)``, at most 200 000.
        rounds: train/evaluate rounds the timesteps and the budget are split into.
        n_envs: environments; above 1, ``make_vec(n_envs, **problem.env_kwargs,
            fidelity="surrogate")`` runs them in worker processes (their surrogates are not
            refit by this process's real evaluations).
        n_steps: PPO rollout length per env; None: whole episodes, at least 64 steps (see
            :func:`rollout_sizes`).
        proposals: stochastic episodes sampled from the PPO policy after each round (plus one
            deterministic); None: ``max(16, 2 x budget)``.
        checkpoint_dir: where the agent's state is saved (``ppo_model.zip`` and
            ``ppo_state.json``) at the start and after each training phase; a search with the
            same settings that finds it goes on from there (see the module's docstring),
            whatever ``resume`` says. None: the folder of ``name``, if given.
        ppo_kwargs: overrides of the ``MaskablePPO`` arguments (defaults: ``gamma=1.0``,
            ``ent_coef=0.01``, ``batch_size`` a divisor of the rollout, half of it by default,
            ``device="cpu"``).
        verbose: SB3's verbosity.
        resume: with the folder of ``name``, go on from its checkpoint; False empties the
            folder first (a new search starts a new agent).
        name: the search's name; without ``checkpoint_dir``, the state is kept in
            ``cache_dir() / "agents" / file_safe(name)``. None (and no ``checkpoint_dir``):
            nothing is saved.

    Raises:
        ValueError: a bad ``rounds``, ``n_envs``, ``timesteps`` or ``n_steps``, or (when the
            search starts) a ``batch_size`` that leaves a minibatch of one sample.
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
        *,
        resume: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(resume=resume, name=name)
        for what, value, low in (("rounds", rounds, 1), ("n_envs", n_envs, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
        if timesteps is not None and (not isinstance(timesteps, int) or timesteps < 1):
            raise ValueError(f"timesteps must be an integer >= 1 or None, got {timesteps!r}")
        if n_steps is not None and (not isinstance(n_steps, int) or n_steps < 1):
            raise ValueError(f"n_steps must be an integer >= 1 or None, got {n_steps!r}")
        self.timesteps = timesteps
        self.rounds = rounds
        self.n_envs = n_envs
        self.n_steps = n_steps
        self.proposals = proposals
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self._start_over = self.checkpoint_dir is None and name is not None and not resume
        if self.checkpoint_dir is None and name is not None:
            self.checkpoint_dir = state_folder(name)
        self.ppo_kwargs = dict(ppo_kwargs or {})
        self.verbose = verbose

    @property
    def checkpoint_path(self) -> Path | None:
        """The model file in ``checkpoint_dir`` (None without one)."""
        return None if self.checkpoint_dir is None else self.checkpoint_dir / CHECKPOINT_NAME

    def run(self, session: Session) -> None:
        if self._start_over:
            self._clear()
        problem = session.problem
        n_layers = len(problem.layers())
        kwargs = self._ppo_arguments(session, n_layers)
        total = self.timesteps or min(n_layers * max(128, 32 * session.budget), MAX_TIMESTEPS)
        proposals = self.proposals if self.proposals is not None else max(16, 2 * session.budget)
        settings = self._settings(session, kwargs, total, proposals)
        sampler_env = surrogate_env(problem)
        venv = self._make_venv(session)
        pool: Pool = {}
        collector = callback_class()(session, pool)
        problem.evaluator.reference(SURROGATE)  # the surrogate's scale, before any seeding
        try:
            model, start = self._restore(venv, session, settings, pool)
            if model is None:
                from sb3_contrib import MaskablePPO

                model = MaskablePPO("MlpPolicy", venv, **kwargs)
                self._save(model, session, settings, pool, 0)
            logger_without_folder(model)
            for r in range(start, self.rounds):
                target = total * (r + 1) // self.rounds
                if model.num_timesteps < target:
                    model.set_random_seed(_phase_seed(session.seed, r, "learn"))
                    model.learn(
                        target - model.num_timesteps, callback=collector, reset_num_timesteps=False
                    )
                    if collector.stop is not None:
                        raise collector.stop
                self._save(model, session, settings, pool, r)
                model.set_random_seed(_phase_seed(session.seed, r, "propose"))
                self._propose(model, sampler_env, session, proposals, r, pool)
                for policy, m in polished(session, list(pool.values())):
                    add_to_pool(pool, session, session.record_surrogate(policy, m, phase="polish"))
                share = math.ceil(session.remaining / (self.rounds - r))
                self._spend(session, pool, share, r)
        finally:
            venv.close()
        session.result.info["timesteps"] = int(model.num_timesteps)

    # --- pieces -------------------------------------------------------------------------------
    def _ppo_arguments(self, session: Session, n_layers: int) -> dict[str, Any]:
        """MaskablePPO's keyword arguments: the defaults, the overrides, safe rollout sizes."""
        kwargs: dict[str, Any] = {
            "gamma": 1.0,
            "ent_coef": 0.01,
            "seed": session.seed,
            "device": "cpu",
            "verbose": self.verbose,
            **self.ppo_kwargs,
        }
        kwargs["n_steps"], kwargs["batch_size"] = rollout_sizes(
            n_layers,
            self.n_envs,
            kwargs.get("n_steps", self.n_steps),
            kwargs.get("batch_size"),
            bool(kwargs.get("normalize_advantage", True)),
        )
        return kwargs

    def _settings(
        self, session: Session, kwargs: dict[str, Any], total: int, proposals: int
    ) -> dict[str, Any]:
        """What a checkpoint must have been made with to be continued (JSON-ready)."""
        problem = session.problem
        return json.loads(
            json.dumps(
                {
                    "model": problem.evaluator.spec.name,
                    "target": problem.evaluator.device.name,
                    "fidelity": problem.fidelity,
                    "layers": problem.layers(),
                    "precisions": list(problem.precisions),
                    "reward_weights": dict(problem.reward.weights),
                    "accuracy_tolerance": problem.reward.tolerance,
                    "budget": session.budget,
                    "seed": session.seed,
                    "timesteps": total,
                    "rounds": self.rounds,
                    "n_envs": self.n_envs,
                    "proposals": proposals,
                    "ppo": {k: v for k, v in kwargs.items() if k != "verbose"},
                },
                default=repr,
            )
        )

    def _make_venv(self, session: Session) -> Any:
        """One :func:`surrogate_env` here, or ``n_envs`` rebuilt by name in worker processes
        (:func:`autoprec.envs.vec.make_vec` of ``problem.env_kwargs``)."""
        if self.n_envs == 1:
            from stable_baselines3.common.monitor import Monitor
            from stable_baselines3.common.vec_env import DummyVecEnv

            venv = DummyVecEnv([lambda: Monitor(surrogate_env(session.problem))])
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

    def _clear(self) -> None:
        """Delete the files of ``checkpoint_dir`` (a new search starts a new agent); what
        cannot be deleted (a read-only disk) stays, and is continued only if it matches."""
        with contextlib.suppress(OSError):
            for item in self.checkpoint_dir.iterdir():
                if item.is_file():
                    item.unlink()

    def _save(
        self, model: Any, session: Session, settings: dict[str, Any], pool: Pool, round_: int
    ) -> None:
        """Checkpoint the state at the start of round ``round_``'s proposals (or, before any
        training, of the search): the model, then the state that names the model's digest.

        Fail-soft, as a cache: a file that cannot be written (a full or read-only disk) is
        one note and the search goes on without a checkpoint; a folder (or anything not a
        file) in the way, already warned of by :meth:`_restore`, is left alone.
        """
        from autoprec.cache import write_entry

        path = self.checkpoint_path
        if path is None or any(in_the_way(p) for p in (path, path.with_name(STATE_NAME))):
            return
        buffer = io.BytesIO()
        model.save(buffer)
        data = buffer.getvalue()
        if not write_entry(path, lambda fh: fh.write(data), binary=True, what=_WHAT):
            return
        state = {
            "format": STATE_FORMAT,
            "model_sha256": hashlib.sha256(data).hexdigest(),
            "settings": settings,
            "round": round_,
            "num_timesteps": int(model.num_timesteps),
            "pool": [[reward, policy] for reward, policy in pool.values()],
            "real": [[t.policy, t.attrs] for t in session.result.real_trials],
        }
        text = json.dumps(state, default=repr)
        if write_entry(path.with_name(STATE_NAME), lambda fh: fh.write(text), what=_WHAT):
            session.result.info["checkpoint"] = str(path)

    def _restore(
        self, venv: Any, session: Session, settings: dict[str, Any], pool: Pool
    ) -> tuple[Any, int]:
        """``(model, round)`` from the checkpoint, with the pool and the real trials (re-read
        through the evaluator's cache) as they were; ``(None, 0)`` without a usable
        checkpoint."""
        path = self.checkpoint_path
        if path is None:
            return None, 0
        state_path = path.with_name(STATE_NAME)
        if not path.exists() and not in_the_way(state_path):
            return None, 0
        try:
            state = parse_state(state_path, path)
            reason = mismatch(state, settings, path)
            if reason is None:
                from sb3_contrib import MaskablePPO

                model = MaskablePPO.load(path, env=venv, device="cpu")
        except CheckpointError as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - any damage: start over (same result, later)
            reason = f"it cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
        if reason is not None:
            warnings.warn(
                f"ignoring the PPO checkpoint {path}: {reason}; training again from the start",
                stacklevel=2,
            )
            session.result.info["checkpoint_ignored"] = reason
            return None, 0
        problem = session.problem
        for policy, attrs in state["real"]:
            metrics = problem.evaluate(policy)  # a cache hit; refits the surrogate in order
            session.load(policy, metrics, 0.0, **{**attrs, "loaded": True})
        for reward, policy in state["pool"]:
            pool[session.key(policy)] = (float(reward), dict(policy))
        session.result.info["resumed_from"] = str(path)
        return model, int(state["round"])

    @staticmethod
    def _propose(model: Any, env: Any, session: Session, n: int, round_: int, pool: Pool) -> None:
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
            trial = session.record_surrogate(
                info["policy"],
                metrics,
                metrics.wall_time_s,
                phase="propose",
                round=round_,
                deterministic=i == n,
            )
            add_to_pool(pool, session, trial)

    @staticmethod
    def _spend(session: Session, pool: Pool, k: int, round_: int) -> None:
        """Evaluate for real the ``k`` best distinct proposals not evaluated yet."""
        if k <= 0:
            return
        problem = session.problem
        best = [item for item in pool.values() if session.seen(item[1]) is None]
        # The surrogate may have been refit since: re-rank a shortlist with its predictions.
        shortlist = sorted(best, key=lambda item: -item[0])[: max(8 * k, 64)]
        predicted = [problem.reward(problem.evaluate(p, SURROGATE)) for _, p in shortlist]
        order = sorted(range(len(shortlist)), key=lambda i: (-predicted[i], i))
        session.prefetch(shortlist[i][1] for i in order[:k])  # side by side, where it can
        for i in order[:k]:
            if session.exhausted:
                return
            session.evaluate(shortlist[i][1], surrogate_reward=predicted[i], round=round_)


def _phase_seed(seed: int, round_: int, phase: str) -> int:
    """The seed of one phase of one round, a function of the search's seed only."""
    digest = hashlib.sha256(f"{seed}:{round_}:{phase}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
