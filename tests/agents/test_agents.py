"""The search agents: one shared suite every agent passes, then each agent's own behaviour."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from autoprec.agents import AGENTS, Problem, SearchResult, StopSearch, Trial, search
from autoprec.policy import PrecisionPolicy

from .conftest import TARGET

# Small settings per agent, so that every search here takes a second or two.
FAST = {
    "ppo": {"timesteps": 128, "proposals": 4},
    "tpe": {},
    "nsga2": {},
    "random": {},
    "greedy": {},
    "baseline": {},
}


def _dominates(a: Trial, b: Trial) -> bool:
    x = (a.metrics.loss_delta, -a.metrics.speedup, a.metrics.memory_ratio)
    y = (b.metrics.loss_delta, -b.metrics.speedup, b.metrics.memory_ratio)
    return all(p <= q for p, q in zip(x, y, strict=True)) and x != y


def check_result(result: SearchResult, problem: Problem, budget: int) -> None:
    """What every SearchResult must satisfy."""
    real = result.real_trials
    assert 0 < len(real) <= budget == result.budget
    assert [t.number for t in result.trials] == list(range(len(result.trials)))
    allowed = set(problem.supported())
    for t in result.trials:
        assert list(t.policy) == problem.layers()
        assert set(t.policy.values()) <= allowed
        assert math.isfinite(t.reward)
        assert t.reward == pytest.approx(problem.reward(t.metrics))
        assert t.fidelity == t.metrics.fidelity
    assert all(t.fidelity == problem.fidelity for t in real)
    assert len({tuple(t.policy.values()) for t in real}) == len(real)  # no policy twice
    best = result.best
    assert best is not None and best in real
    assert best.reward == max(t.reward for t in real)
    assert best is next(t for t in real if t.reward == best.reward)  # ties: the earliest
    front = result.pareto
    assert front and all(t in real and not t.metrics.diverged for t in front)
    for a in front:
        assert not any(_dominates(b, a) for b in front)
    for t in real:
        if t not in front and not t.metrics.diverged:
            assert any(_dominates(f, t) for f in front)
    json.dumps(result.to_dict())  # JSON-ready
    assert result.wall_time_s > 0


# --- the shared suite -------------------------------------------------------------------------
@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_every_agent_returns_a_valid_result_within_its_budget(agent, make_problem):
    problem = make_problem()
    seen = []

    class Record:
        def on_trial(self, trial, result):
            seen.append(trial.number)

    result = search(problem, budget=5, seed=0, callbacks=[Record()], agent=agent, **FAST[agent])
    check_result(result, problem, budget=5)
    assert result.agent == agent and not result.stopped
    assert seen == [t.number for t in result.trials]  # every trial, real or surrogate, once
    assert "fp8" not in {p for t in result.trials for p in t.policy.values()}  # a100: no fp8
    assert problem.evaluator.runs <= 5 + 1  # + the fp32 reference
    if agent != "baseline":
        assert len(result.real_trials) == 5


@pytest.mark.parametrize("agent", ["random", "tpe", "ppo"])
def test_stop_search_from_a_callback_returns_the_partial_result(agent, make_problem, tmp_path):
    problem = make_problem()

    class StopAfterTwo:
        def __init__(self):
            self.calls = 0

        def on_trial(self, trial, result):
            self.calls += 1
            if self.calls == 2:
                raise StopSearch

    kwargs = dict(FAST[agent])
    if agent == "ppo":
        kwargs["checkpoint_dir"] = tmp_path / "ckpt"
    result = search(problem, budget=10, callbacks=[StopAfterTwo()], agent=agent, **kwargs)
    assert result.stopped and len(result.trials) == 2
    if agent == "ppo":  # stopped while training on the surrogate; the model is saved
        assert not result.real_trials
        assert (tmp_path / "ckpt" / "ppo_model.zip").exists()
    else:
        assert len(result.real_trials) == 2 and result.best is not None


@pytest.mark.parametrize("agent", ["random", "tpe", "nsga2"])
def test_same_seed_same_trials(agent, make_problem):
    problem = make_problem()
    first = search(problem, budget=6, seed=3, agent=agent)
    second = search(problem, budget=6, seed=3, agent=agent)
    assert [t.policy for t in first.trials] == [t.policy for t in second.trials]
    assert [t.reward for t in first.trials] == [t.reward for t in second.trials]


# --- the API ----------------------------------------------------------------------------------
def test_bad_arguments_raise_value_errors(make_problem):
    problem = make_problem()
    with pytest.raises(ValueError, match="unknown agent 'sgd'.*ppo, tpe, nsga2"):
        search(problem, budget=3, agent="sgd")
    with pytest.raises(ValueError, match="takes no option.*'population_size'"):
        search(problem, budget=3, agent="tpe", population_size=4)
    for budget in (0, 10**400, True):  # the command's range: no minutes of surrogate for 10**400
        with pytest.raises(ValueError, match="budget must be an integer between 1 and 10,000"):
            search(problem, budget=budget, agent="random")
    with pytest.raises(ValueError, match="fidelity must be a real one"):
        Problem(problem.evaluator, fidelity="surrogate")
    with pytest.raises(ValueError, match="unknown precision 'bf8'"):
        Problem(problem.evaluator, precisions=("fp32", "bf8"))
    with pytest.raises(ValueError, match="none of the precisions fp8 runs"):
        Problem(problem.evaluator, precisions=("fp8",))
    with pytest.raises(ValueError, match="start must be"):
        search(problem, budget=3, agent="greedy", start="bf16")


def test_default_action_set_and_reward_are_the_shared_ones(make_problem):
    from autoprec.evaluate.reward import RewardConfig
    from autoprec.precision import PRECISION_NAMES

    problem = make_problem(precisions=PRECISION_NAMES, target="h100-sxm")
    assert problem.precisions == make_problem(target="h100-sxm").precisions == PRECISION_NAMES
    assert problem.reward == RewardConfig()
    strict = make_problem(reward=RewardConfig({"accuracy": 20.0}, tolerance=0.01))
    trial = search(strict, budget=1, agent="baseline").trials[0]
    assert (
        trial.reward
        == strict.reward(trial.metrics)
        == RewardConfig({"accuracy": 20.0}, 0.01)(trial.metrics)
    )


def test_import_is_light():
    code = (
        "import sys, autoprec.agents; "
        "assert autoprec.agents.AGENTS['random'].name == 'random'; "
        "print(sorted(m for m in ('torch', 'optuna', 'stable_baselines3', 'gymnasium', "
        "'autoprec.agents.ppo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_agent_takes_resume_and_name():
    from autoprec.agents.registry import agent_options

    for name, cls in AGENTS.items():
        parameters = agent_options(cls)
        assert {"resume", "name"} <= set(parameters), name
        assert cls.name == name


def test_trial_rows_are_the_tables_and_csvs_rows(make_problem):
    result = search(make_problem(), budget=2, agent="baseline")
    trial = result.trials[0]
    row = trial.row()
    from autoprec.pipeline.export import PARETO_FIELDS

    assert list(row)[:2] == ["number", "fidelity"] and list(row)[-1] == "policy"
    assert set(row) == {"fidelity", "policy", *PARETO_FIELDS}
    assert row["policy"] == " ".join(trial.policy.values()) and row["reward"] == trial.reward
    summary = result.summary_rows()[0]
    assert list(summary) == [*list(row)[:-1], "pareto", "policy"]
    assert {k: summary[k] for k in row} == row


def test_small_space_is_exhausted_without_repeats(make_problem):
    problem = make_problem(precisions=("fp32", "bf16"))  # 2**4 = 16 policies
    result = search(problem, budget=40, seed=0, agent="random")
    assert len(result.real_trials) == 16
    assert problem.evaluator.runs <= 16


def test_best_policy_carries_metrics_provenance_and_loss_scaling(make_problem, spec):
    problem = make_problem()
    result = search(problem, budget=4, agent="baseline")
    names = [t.attrs["name"] for t in result.trials]
    assert names == ["fp32", "amp-bf16", "amp-fp16", "hardware-default"]
    fp16 = result.trials[2]
    fp16_policy = SearchResult(agent="x", trials=[fp16], budget=1).best_policy(spec)
    assert fp16_policy.loss_scaling is not None  # evaluated with dynamic loss scaling
    policy = result.best_policy(spec)
    assert isinstance(policy, PrecisionPolicy)
    assert dict(policy.layers) == result.best.policy
    assert policy.metrics["reward"] == pytest.approx(result.best.reward)
    assert policy.provenance["agent"] == "baseline"
    assert policy.target.device == problem.evaluator.device.name
    assert policy.model.tunable_layers == len(problem.layers())
    assert PrecisionPolicy.from_dict(policy.to_dict()) == policy
    assert SearchResult(agent="x").best_policy(spec) is None
    assert Trial.from_dict(json.loads(json.dumps(fp16.to_dict()))) == fp16


def test_baselines_hit_the_evaluators_cache_of_the_policies_themselves(make_problem):
    from autoprec.hardware.defaults import amp_policy, default_policy

    problem = make_problem()
    search(problem, budget=4, agent="baseline")
    ev = problem.evaluator
    runs = ev.runs
    ev.evaluate(amp_policy(ev.device, "fp16"))
    ev.evaluate(default_policy(problem.table, ev.device))
    assert ev.runs == runs


def test_baseline_skips_what_is_not_in_the_action_set(make_problem):
    problem = make_problem(precisions=("fp32", "bf16"))
    result = search(problem, budget=10, agent="baseline")
    names = [t.attrs["name"] for t in result.trials]
    assert names[:2] == ["fp32", "amp-bf16"] and "amp-fp16" not in names


# --- greedy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("start", ["fp32", "default"])
def test_greedy_lowers_least_sensitive_first_and_keeps_the_tolerance(start, make_problem):
    from autoprec.agents import GreedyAgent
    from autoprec.agents.base import Session

    problem = make_problem()
    result = search(problem, budget=8, agent="greedy", start=start)
    check_result(result, problem, budget=8)
    first = result.trials[0]
    assert first.attrs["step"] == "start"
    if start == "fp32":
        assert set(first.policy.values()) == {"fp32"}
    order = GreedyAgent().order(Session(problem, 1, 0, (), "greedy"))
    assert sorted(order) == sorted(problem.layers())
    positions = [order.index(t.attrs["step"]) for t in result.trials[1:]]
    descents = sum(b < a for a, b in zip(positions[:-1], positions[1:], strict=True))
    assert descents <= 2  # one layer after the other, in at most max_passes=3 passes
    best = result.best
    assert best.reward >= first.reward
    if best is not first:
        assert best.metrics.loss_delta <= problem.reward.tolerance


# --- optuna -----------------------------------------------------------------------------------
def test_tpe_keeps_its_study_under_the_search_name(make_problem, tmp_path):
    import optuna

    from autoprec.agents.naming import search_name

    problem = make_problem()
    storage = f"sqlite:///{tmp_path / 'named.db'}"
    optuna.logging.set_verbosity(optuna.logging.INFO)
    first = search(problem, budget=2, agent="tpe", storage=storage, name="n")
    assert optuna.logging.get_verbosity() == optuna.logging.INFO  # quiet only while it works
    again = search(problem, budget=2, agent="tpe", storage=storage, name="n")
    resumed = search(problem, budget=3, agent="tpe", storage=storage, name="n", resume=True)
    names = [r.info["study_name"] for r in (first, again, resumed)]
    assert names == ["n", "n-2", "n"]  # a new search starts a new study; --resume finds it
    assert len(resumed.real_trials) == 3 and sum(t.attrs.get("loaded", 0) for t in resumed.trials)
    default = search(problem, budget=1, seed=4, agent="tpe", storage=storage)
    ev = problem.evaluator
    expected = search_name(ev.spec.name, ev.data.name, ev.device.name, "tpe", 4)
    assert default.info["study_name"] == expected == f"tinycnn-{ev.data.name}-{TARGET}-tpe-seed4"


def test_tpe_resumes_a_study_without_repeating_it(make_problem, tmp_path):
    import optuna

    problem = make_problem()
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    first = search(problem, budget=3, agent="tpe", storage=storage, study_name="s")
    assert len(first.real_trials) == 3 and problem.evaluator.runs == 3
    second = search(problem, budget=6, agent="tpe", storage=storage, study_name="s")
    check_result(second, problem, budget=6)
    assert len(second.real_trials) == 6
    assert [t.attrs.get("loaded", False) for t in second.trials] == [True] * 3 + [False] * 3
    assert [t.policy for t in second.trials[:3]] == [t.policy for t in first.trials]
    assert problem.evaluator.runs == 6  # each policy trained once
    study = optuna.load_study(study_name="s", storage=storage)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(complete) == 6
    assert all({"metrics", "reward", "fidelity"} <= set(t.user_attrs) for t in complete)
    numbers = [t.attrs["optuna_trial"] for t in second.trials]
    assert len(set(numbers)) == 6
    again = search(problem, budget=6, agent="tpe", storage=storage, study_name="s")
    assert len(again.real_trials) == 6 and problem.evaluator.runs == 6  # nothing left to do


def test_copies_of_enqueued_baselines_left_when_the_budget_is_spent_do_not_wait(
    make_problem, tmp_path
):
    """Two workers starting together on a new study both enqueue the baselines (Optuna's
    skip_if_exists is not atomic across processes); a copy left when the budget was spent
    stayed WAITING in the PostgreSQL study of the CI run of 2026-12-05. The baselines beyond
    the budget stay enqueued: a resumed search with a larger budget evaluates them."""
    import optuna
    from optuna.trial import TrialState

    problem = make_problem()
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    first = search(problem, budget=2, agent="tpe", storage=storage, study_name="s")
    study = optuna.load_study(study_name="s", storage=storage)
    waiting = [
        t.system_attrs["fixed_params"] for t in study.get_trials(states=(TrialState.WAITING,))
    ]
    assert len(waiting) >= 1  # the baselines beyond the budget
    for t in first.real_trials:  # the other worker's copies of the baselines it evaluated
        study.enqueue_trial(t.policy)
    again = search(problem, budget=2, agent="tpe", storage=storage, study_name="s")
    assert len(again.real_trials) == 2 and problem.evaluator.runs == 2
    trials = optuna.load_study(study_name="s", storage=storage).get_trials()
    states = [t.state for t in trials]
    assert (
        states
        == [TrialState.COMPLETE] * 2 + [TrialState.WAITING] * len(waiting) + [TrialState.PRUNED] * 2
    )
    assert [t.user_attrs["duplicate_of"] for t in trials[-2:]] == [0, 1]
    resumed = search(problem, budget=2 + len(waiting), agent="tpe", storage=storage, study_name="s")
    assert [t.policy for t in resumed.real_trials[2:]] == waiting


def test_a_study_of_another_fidelity_is_refused(make_problem, tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    search(make_problem(), budget=1, agent="tpe", storage=storage, study_name="s")
    with pytest.raises(ValueError, match="study 's' was made for fidelity='short'"):
        search(
            make_problem(fidelity="full"), budget=1, agent="tpe", storage=storage, study_name="s"
        )


WORKER = """
import json, sys, torch
torch.set_num_threads(1)
from autoprec.agents import Problem, search
from autoprec.data import load_dataset_for
from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.models import load_model
storage, seed, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
spec = load_model("tinycnn", num_classes=10)
data = load_dataset_for(spec, "digits", seed=0)
ev = Evaluator(spec, data, "a100-40gb-sxm", config=EvaluatorConfig(steps=5, warm_start_steps=20))
r = search(Problem(ev), budget=budget, seed=seed, agent="tpe", storage=storage, study_name="w")
own = sum(1 for t in r.real_trials if not t.attrs.get("loaded"))
print(json.dumps({"real": len(r.real_trials), "own": own, "runs": ev.runs}))
"""


@pytest.mark.slow
def test_two_processes_share_one_study_and_its_budget(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    budget = 8
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, storage, str(seed), str(budget)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for seed in (1, 2)
    ]
    reports = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    print(reports)
    study = optuna.load_study(study_name="w", storage=storage)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(complete) == budget
    assert len({tuple(sorted(t.params.items())) for t in complete}) == budget  # all distinct
    # Each worker told its own trials; its result also holds those the other had finished. A
    # worker starved past the heartbeat's grace period (a loaded machine) has its running trial
    # failed as stale and retried by the other: that one is evaluated twice, and said so.
    failed = study.get_trials(states=(optuna.trial.TrialState.FAIL,))
    stale = [t for t in failed if "autoprec_skipped" not in t.user_attrs]
    assert sum(r["own"] for r in reports) == budget + len(stale), (reports, len(stale))
    assert all(r["own"] <= r["real"] <= budget for r in reports), reports
    assert max(r["real"] for r in reports) == budget, reports  # the last to end saw them all


def test_a_trial_failed_by_another_worker_keeps_its_result_without_an_error(tmp_path):
    """A worker starved past the heartbeat's grace period finds its trial failed by the other
    worker when it comes to record the result: a warning, not a crash (the user attrs too)."""
    import optuna

    from autoprec.agents.optuna_study import tell

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    mine = optuna.create_study(study_name="w", storage=storage)
    trial = mine.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    other = optuna.load_study(study_name="w", storage=storage)
    other.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # stale, as the other saw it
    with pytest.warns(UserWarning, match=f"trial {trial.number} was failed by another worker"):
        tell(mine, trial, [1.0], {"reward": 1.0, "fidelity": "short"})
    (stored,) = other.get_trials()
    assert stored.state == optuna.trial.TrialState.FAIL and "reward" not in stored.user_attrs


def test_nsga2_with_a_multi_objective_tpe_sampler(make_problem):
    problem = make_problem()
    result = search(problem, budget=5, agent="nsga2", sampler="tpe")
    check_result(result, problem, budget=5)
    with pytest.raises(ValueError, match="sampler must be"):
        search(problem, budget=5, agent="nsga2", sampler="cma")


# --- ppo --------------------------------------------------------------------------------------
def test_ppo_records_surrogate_episodes_and_resumes_from_its_checkpoint(make_problem, tmp_path):
    problem = make_problem()
    ckpt = tmp_path / "ckpt"
    result = search(problem, budget=3, agent="ppo", timesteps=128, proposals=4, checkpoint_dir=ckpt)
    check_result(result, problem, budget=3)
    surrogate = [t for t in result.trials if not t.real]
    phases = {t.attrs["phase"] for t in surrogate}
    assert phases == {"train", "propose", "polish"}  # polish: agents/polish.py
    assert all(t.fidelity == "surrogate" and t.metrics.steps == 0 for t in surrogate)
    assert result.info["timesteps"] >= 128
    assert (ckpt / "ppo_model.zip").exists()
    # Every real trial was proposed by PPO first.
    proposed = {tuple(t.policy.values()) for t in surrogate}
    assert all(tuple(t.policy.values()) in proposed for t in result.real_trials)

    resumed = search(
        problem, budget=3, agent="ppo", timesteps=128, proposals=4, checkpoint_dir=ckpt
    )
    assert resumed.info["resumed_from"] == str(ckpt / "ppo_model.zip")
    # no training
    assert all(t.attrs["phase"] in ("propose", "polish") for t in resumed.trials if not t.real)
    assert resumed.real_trials


POPPER = """
import json, sys, optuna
from autoprec.agents.optuna_study import ask_lock
optuna.logging.set_verbosity(optuna.logging.WARNING)
url = sys.argv[1]
study = optuna.load_study(study_name="q", storage=url)
numbers = []
for _ in range(15):
    with ask_lock(url):
        numbers.append(study.ask().number)
print(json.dumps(numbers))
"""


def test_workers_asking_together_on_sqlite_never_get_the_same_enqueued_trial(tmp_path):
    """Optuna pops a WAITING trial with a row lock SQLite does not have: without autoprec's
    ask lock, two processes popping 30 enqueued trials together got the same trial 1 to 3
    times in every one of 3 tries here; with it, never."""
    import optuna

    storage = f"sqlite:///{tmp_path / 'queue.db'}"
    study = optuna.create_study(study_name="q", storage=storage)
    for x in range(30):
        study.enqueue_trial({"x": x})
    workers = [
        subprocess.Popen([sys.executable, "-c", POPPER, storage], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    numbers = [n for w in workers for n in json.loads(w.communicate(timeout=120)[0])]
    assert sorted(numbers) == list(range(30))


@pytest.mark.slow
@pytest.mark.parametrize(("agent", "calls"), [("ppo", 2), ("random", 1), ("baseline", 1)])
def test_agents_hand_their_proposals_to_the_workers_and_find_what_they_find_alone(
    agent, calls, spec, data, tmp_path
):
    """``ppo`` hands each round's proposals to the evaluator's workers at once, ``random`` its
    draws, ``baseline`` its list (never more than the budget, in the order evaluated); with one
    thread each, as here, the search is the one it is without workers."""
    from autoprec.evaluate import Evaluator, EvaluatorConfig

    from .conftest import SMALL

    def problem(folder: str) -> Problem:
        return Problem(
            Evaluator(
                spec, data, TARGET, cache_dir=tmp_path / folder, config=EvaluatorConfig(**SMALL)
            )
        )

    options = {"budget": 3, "seed": 0, "agent": agent}
    if agent == "ppo":
        options |= {"timesteps": 128, "proposals": 4}
    alone = search(problem("alone"), **options)
    pooled_problem = problem("pooled")
    evaluator = pooled_problem.evaluator
    evaluator.reference()
    assert evaluator.start_workers(2) is None
    handed: list[list[dict]] = []
    prefetch = evaluator.prefetch

    def recording(policies, fidelity=None):
        handed.append([{k: v.value for k, v in p.layers.items()} for p in policies])
        return prefetch(policies, fidelity)

    evaluator.prefetch = recording
    try:
        pooled = search(pooled_problem, **options)
    finally:
        evaluator.stop_workers()
    assert len(handed) == calls
    assert [p for batch in handed for p in batch] == [t.policy for t in pooled.real_trials]
    assert [t.policy for t in pooled.real_trials] == [t.policy for t in alone.real_trials]
    losses = [t.metrics.loss for t in pooled.real_trials]
    assert losses == [t.metrics.loss for t in alone.real_trials]
