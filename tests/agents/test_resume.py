"""Interrupted and resumed searches spend their budget once and end as uninterrupted ones.

An interruption is simulated in the process: the evaluator raises ``KeyboardInterrupt`` (what
SIGTERM becomes in ``autoprec search``) when the k-th real evaluation starts, so that it never
finishes; nothing else is saved on the way out, as after SIGKILL. A SIGKILL that leaves an
Optuna trial RUNNING is a real one, in a subprocess.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys

import pytest

from autoprec.agents import Problem, search

from .conftest import SMALL, TARGET

PPO = {"timesteps": 128, "proposals": 4}


def make(spec, data, cache, fail_at=None):
    """A Problem on a fresh evaluator with its own cache folder; with ``fail_at``, its
    ``fail_at``-th real evaluation raises KeyboardInterrupt before it runs."""
    from autoprec.evaluate import Evaluator, EvaluatorConfig

    evaluator = Evaluator(
        copy.deepcopy(spec), data, TARGET, cache_dir=cache, config=EvaluatorConfig(**SMALL)
    )
    if fail_at is not None:
        evaluate, calls = evaluator.evaluate, []

        def interrupted(policy, fidelity=None):
            if (fidelity or evaluator.fidelity) != "surrogate":
                calls.append(policy)
                if len(calls) == fail_at:
                    raise KeyboardInterrupt
            return evaluate(policy, fidelity)

        evaluator.evaluate = interrupted
    return Problem(evaluator)


def outcome(result):
    return [(t.policy, t.reward) for t in result.real_trials]


@pytest.mark.parametrize("fail_at", [2, 5])  # in the first round's evaluations, in the second's
def test_ppo_resumed_equals_uninterrupted(spec, data, tmp_path, fail_at):
    budget = 6
    plain = make(spec, data, tmp_path / "plain")
    expected = search(plain, budget, agent="ppo", checkpoint_dir=tmp_path / "a", **PPO)
    assert len(expected.real_trials) == budget

    cache, ckpt = tmp_path / "cache", tmp_path / "b"
    killed = make(spec, data, cache, fail_at=fail_at)
    with pytest.raises(KeyboardInterrupt):
        search(killed, budget, agent="ppo", checkpoint_dir=ckpt, **PPO)
    resumed_problem = make(spec, data, cache)
    resumed = search(resumed_problem, budget, agent="ppo", checkpoint_dir=ckpt, **PPO)

    assert resumed.info["resumed_from"] == str(ckpt / "ppo_model.zip")
    assert outcome(resumed) == outcome(expected)  # the same policies, in the same order
    assert resumed.best.policy == expected.best.policy
    # every real evaluation ran once: those before the interruption and the rest after it
    runs = killed.evaluator.runs + resumed_problem.evaluator.runs
    assert runs == plain.evaluator.runs
    # a resumed search of a finished one trains nothing and evaluates nothing again
    again_problem = make(spec, data, cache)
    again = search(again_problem, budget, agent="ppo", checkpoint_dir=ckpt, **PPO)
    assert outcome(again) == outcome(expected) and again_problem.evaluator.runs == 0


def test_ppo_without_its_checkpoint_replays_to_the_same_result(spec, data, tmp_path):
    budget = 4
    plain = make(spec, data, tmp_path / "plain")
    expected = search(plain, budget, agent="ppo", **PPO)
    cache = tmp_path / "cache"
    killed = make(spec, data, cache, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        search(killed, budget, agent="ppo", **PPO)
    resumed_problem = make(spec, data, cache)
    resumed = search(resumed_problem, budget, agent="ppo", **PPO)
    assert outcome(resumed) == outcome(expected)
    # what the killed search finished came from the cache: no fine-tune ran twice
    runs = killed.evaluator.runs + resumed_problem.evaluator.runs
    assert runs == plain.evaluator.runs


def test_ppo_ignores_a_damaged_or_foreign_checkpoint(spec, data, tmp_path):
    ckpt = tmp_path / "ckpt"
    expected = search(make(spec, data, tmp_path / "c"), 3, agent="ppo", checkpoint_dir=ckpt, **PPO)
    (ckpt / "ppo_model.zip").write_bytes(b"junk")
    with pytest.warns(UserWarning, match="ignoring the PPO checkpoint .*ppo_model.zip"):
        again = search(make(spec, data, tmp_path / "c"), 3, agent="ppo", checkpoint_dir=ckpt, **PPO)
    assert outcome(again) == outcome(expected) and "resumed_from" not in again.info
    with pytest.warns(UserWarning, match=r"other settings \(budget"):
        other = search(make(spec, data, tmp_path / "c"), 4, agent="ppo", checkpoint_dir=ckpt, **PPO)
    assert len(other.real_trials) == 4


# --- tpe --------------------------------------------------------------------------------------
def _study(storage, name="s"):
    import optuna

    return optuna.load_study(study_name=name, storage=storage)


def _states(storage, name="s"):
    return [t.state.name for t in _study(storage, name).trials]


def uninterrupted_tpe(spec, data, tmp_path, budget):
    """The TPE search the interrupted ones must equal: own cache, own storage."""
    plain = make(spec, data, tmp_path / "plain")
    storage = f"sqlite:///{tmp_path / 'plain.db'}"
    return plain, search(plain, budget, agent="tpe", storage=storage, study_name="s")


def test_tpe_resumed_after_an_interruption_equals_uninterrupted(spec, data, tmp_path):
    budget = 8
    plain, expected = uninterrupted_tpe(spec, data, tmp_path, budget)

    cache, storage = tmp_path / "cache", f"sqlite:///{tmp_path / 'b.db'}"
    killed = make(spec, data, cache, fail_at=6)  # after the four baselines
    with pytest.raises(KeyboardInterrupt):
        search(killed, budget, agent="tpe", storage=storage, study_name="s")
    assert _states(storage).count("FAIL") == 1 and _states(storage)[-1] == "WAITING"  # retry
    resumed_problem = make(spec, data, cache)
    resumed = search(resumed_problem, budget, agent="tpe", storage=storage, study_name="s")
    assert outcome(resumed) == outcome(expected)
    assert killed.evaluator.runs + resumed_problem.evaluator.runs == plain.evaluator.runs
    assert _states(storage).count("COMPLETE") == budget


KILLED_WORKER = """
import json, os, signal, sys, torch
torch.set_num_threads(1)
from autoprec.agents import Problem, search
from autoprec.data import load_dataset_for
from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.models import load_model
storage, cache, budget, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
target, small = sys.argv[5], json.loads(sys.argv[6])
torch.manual_seed(0)
spec = load_model("tinycnn", num_classes=10)
data = load_dataset_for(spec, "digits", seed=0)
ev = Evaluator(spec, data, target, cache_dir=cache, config=EvaluatorConfig(**small))
evaluate, calls = ev.evaluate, []
def killing(policy, fidelity=None):
    calls.append(policy)
    if len(calls) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-trial: it stays RUNNING
    return evaluate(policy, fidelity)
ev.evaluate = killing
search(Problem(ev), budget=budget, seed=0, agent="tpe", storage=storage, study_name="s")
"""


@pytest.mark.slow
def test_tpe_after_sigkill_retries_the_running_trial_and_spends_the_budget(spec, data, tmp_path):
    budget = 8
    _, expected = uninterrupted_tpe(spec, data, tmp_path, budget)

    cache, storage = tmp_path / "cache", f"sqlite:///{tmp_path / 'b.db'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", KILLED_WORKER, storage, str(cache), str(budget), "6", TARGET]
    args.append(json.dumps(SMALL))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _states(storage).count("RUNNING") == 1  # what SIGKILL leaves behind

    resumed_problem = make(spec, data, cache)
    resumed = search(resumed_problem, budget, agent="tpe", storage=storage, study_name="s")
    states = _states(storage)
    assert states.count("COMPLETE") == budget and "RUNNING" not in states  # 29 of 30 before
    assert states.count("FAIL") == 1
    assert outcome(resumed) == outcome(expected)
    assert resumed_problem.evaluator.runs == budget - 5  # five finished before the kill
    retry = next(t for t in _study(storage).trials if "failed_trial" in t.system_attrs)
    assert retry.state.name == "COMPLETE"


def _running_trial(storage, worker, name="s"):
    """A study holding one RUNNING trial of ``worker`` (the first of a fresh search)."""
    import optuna

    study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
    trial = study.ask()
    trial.suggest_categorical("x", ["a"])
    trial.set_user_attr("autoprec_worker", worker)
    return study


def test_a_live_workers_running_trial_is_never_failed(tmp_path):
    import optuna

    from autoprec.agents.optuna_agents import TPEAgent
    from autoprec.agents.optuna_study import WORKER, process_start, retry_callback

    storage = f"sqlite:///{tmp_path / 'live.db'}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = {**WORKER, "pid": child.pid, "start": process_start(child.pid)}
        study = _running_trial(storage, live)
        TPEAgent(storage=storage, study_name="s")._fail_stale(study)
        assert [t.state.name for t in study.trials] == ["RUNNING"]
        # another machine's trial with a fresh heartbeat is alive too
        other = optuna.storages.RDBStorage(storage, heartbeat_interval=1, grace_period=30)
        study2 = _running_trial(other, {"host": "elsewhere", "pid": 1}, name="t")
        other.record_heartbeat(study2.trials[0]._trial_id)
        TPEAgent(storage=other, study_name="t")._fail_stale(study2)
        assert [t.state.name for t in study2.trials] == ["RUNNING"]
    finally:
        child.kill()
        child.wait()
    # once the process is gone, its trial is failed and retried
    agent = TPEAgent(storage=storage, study_name="s")
    agent._retry = retry_callback()
    agent._fail_stale(study)
    assert [t.state.name for t in study.trials] == ["FAIL", "WAITING"]


def test_a_stale_trial_of_another_machine_is_failed_after_its_grace_period(spec, data, tmp_path):
    import time

    import optuna

    from autoprec.agents.optuna_study import retry_callback

    storage = optuna.storages.RDBStorage(
        f"sqlite:///{tmp_path / 'other.db'}",
        heartbeat_interval=1,
        grace_period=2,
        heartbeat_stale_trial_callback=retry_callback(),
    )
    problem = make(spec, data, tmp_path / "cache")
    first = search(problem, 2, agent="tpe", storage=storage, study_name="s")
    study = optuna.load_study(study_name="s", storage=storage)
    trial = study.ask(dict(study.trials[-1].distributions))  # a machine that died mid-trial
    trial.set_user_attr("autoprec_worker", {"host": "elsewhere", "pid": 1})
    storage.record_heartbeat(trial._trial_id)
    begin = time.monotonic()
    result = search(problem, 3, agent="tpe", storage=storage, study_name="s")
    assert 2 <= time.monotonic() - begin < 30  # waited for the heartbeat to go stale
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") == 3 and "RUNNING" not in states
    assert len(result.real_trials) == 3 and outcome(result)[:2] == outcome(first)
