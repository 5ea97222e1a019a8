"""Agents against the true optimum: every tinycnn policy evaluated, then each agent's regret.

1. Ground truth. `tinycnn` has 4 tunable layers; with 5 precisions that is 5**4 = 625 policies.
   Each is evaluated once at `short` fidelity through `autoprec.evaluate.Evaluator`, as the
   agents evaluate their proposals (`Problem.evaluate`: default fp32, the layer map, dynamic
   loss scaling when a layer is fp16), so every later agent evaluation is a cache hit. The
   evaluations live in the evaluator's SQLite cache (`--cache-dir`): running the script again
   resumes where it stopped. The true best reward is `autoprec.envs.reward` (the agents'
   reward, default weights and tolerance) of the best policy; the true Pareto front is
   `SearchResult.pareto` over all the policies.
2. Agents. Each of `--agents` searches with each budget of `--budgets` real evaluations, for
   each of `--seeds` seeds, through `autoprec.agents.search` on a fresh evaluator over the same
   cache (so its surrogate learns only from that search's own evaluations, as in a real
   search).
3. Report per agent and budget: median and interquartile range of the regret (true best reward
   minus the agent's best), the share of runs that found the true best, and the hypervolume of
   the agent's Pareto front as a share of the true front's. Objectives, all minimised:
   (loss_delta, -speedup, memory_ratio); reference point: the accuracy tolerance for
   loss_delta, and for -speedup and memory_ratio the worst value over the whole space plus a
   tenth of its range (so every acceptable policy counts). Costs are priced at batch
   `--cost-batch-size` (4096: at the 256 `autoprec search` prices, a tinycnn step on an H100
   is kernel-launch overhead and no precision changes its cost). A plot of regret against budget
   goes to `--plot`.

    python experiments/ground_truth.py --write-docs     # the full run (see experiments/README.md)
    python experiments/ground_truth.py --quick          # 2 precisions (16 policies), for the test
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import (
    DOCS,
    dataset_suffix,
    docs_output,
    invocation,
    md_table,
    parse_args,
    provenance,
    write_section,
)

from autoprec.agents import Problem, SearchResult, Trial, search
from autoprec.cache import cache_dir as default_cache_dir
from autoprec.data import load_dataset_for
from autoprec.defaults import DEFAULT_DATASET
from autoprec.evaluate import Evaluator, EvaluatorConfig, RewardConfig
from autoprec.models import load_model

PLOT = DOCS.parent / "ground-truth-regret.png"
AGENT_NAMES = ["ppo", "tpe", "nsga2", "random", "greedy"]


@dataclass
class Args:
    model: str = "tinycnn"
    dataset: str = DEFAULT_DATASET
    target: str = "h100-sxm"
    precisions: list[str] = field(default_factory=lambda: ["fp32", "tf32", "bf16", "fp16", "fp8"])
    agents: list[str] = field(default_factory=lambda: list(AGENT_NAMES))
    budgets: list[int] = field(default_factory=lambda: [16, 32, 64])
    seeds: int = 5
    steps: int | None = field(default=None, metadata={"help": "short-fidelity steps"})
    cost_batch_size: int = field(
        default=4096,
        metadata={
            "help": "batch the costs are for; at autoprec search's 256 a tinycnn step on an "
            "H100 is all kernel-launch overhead and every policy costs the same"
        },
    )
    accuracy_tolerance: float = 0.05
    ppo_timesteps: int | None = field(default=None, metadata={"help": "PPO's timesteps"})
    cache_dir: Path | None = field(
        default=None, metadata={"help": "evaluation cache (default: autoprec's cache folder)"}
    )
    plot: Path | None = field(
        default=None,
        metadata={
            "help": "regret-against-budget PNG (default with --write-docs: "
            "docs/ground-truth-regret.png, -<dataset> added when not the default dataset; "
            "else none)"
        },
    )
    csv: Path | None = field(default=None, metadata={"help": "every policy's metrics (CSV)"})
    quick: bool = field(
        default=False,
        metadata={"help": "fp32/bf16 only (16 policies), 5 steps, budgets 4 8, one seed"},
    )
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


# --------------------------------------------------------------------------------- hypervolume
def hypervolume(points: Sequence[Sequence[float]], ref: Sequence[float]) -> float:
    """Volume dominated by ``points`` (all objectives minimised) inside the box bounded by
    ``ref``; points not strictly better than ``ref`` in every objective add nothing.

    Slices along the last objective and recurses (exact; fine for fronts of a few hundred
    points in 3 objectives).

    Example:
        >>> hypervolume([(1, 2), (2, 1)], (3, 3))  # two 2x1 boxes overlapping in 1x1
        3.0
    """
    pts = [tuple(map(float, p)) for p in points if all(x < r for x, r in zip(p, ref, strict=True))]
    if not pts:
        return 0.0
    if len(ref) == 1:
        return float(ref[0]) - min(p[0] for p in pts)
    pts.sort(key=lambda p: p[-1])
    volume = 0.0
    for i, p in enumerate(pts):
        upper = pts[i + 1][-1] if i + 1 < len(pts) else float(ref[-1])
        if upper > p[-1]:
            volume += (upper - p[-1]) * hypervolume([q[:-1] for q in pts[: i + 1]], ref[:-1])
    return volume


def objectives(trial: Trial) -> tuple[float, float, float]:
    m = trial.metrics
    return (m.loss_delta, -m.speedup, m.memory_ratio)


def reference_point(truth: SearchResult, tolerance: float) -> tuple[float, float, float]:
    """(tolerance, nadir + 10% of the range) for (-speedup, memory_ratio) over every policy
    that neither diverged nor was infeasible."""
    ok = [objectives(t) for t in truth.trials if not t.metrics.diverged and t.metrics.feasible]
    ref = [tolerance]
    for k in (1, 2):
        values = [p[k] for p in ok]
        ref.append(max(values) + 0.1 * (max(values) - min(values) or 1.0))
    return tuple(ref)


def front_volume(result: SearchResult, ref: Sequence[float]) -> float:
    return hypervolume([objectives(t) for t in result.pareto], ref)


# -------------------------------------------------------------------------------- ground truth
def make_problem(args: Args, cache: Path) -> Problem:
    """A fresh evaluator (and problem) over the shared cache."""
    size = None if args.model in ("tinycnn", "mlp") else 32
    spec = load_model(args.model, num_classes=10, image_size=size)
    data = load_dataset_for(spec, args.dataset, seed=0)
    ev = Evaluator(
        spec,
        data,
        target=args.target,
        cache_dir=cache,
        config=EvaluatorConfig(steps=args.steps, cost_batch_size=args.cost_batch_size),
    )
    reward = RewardConfig(tolerance=args.accuracy_tolerance)
    return Problem(ev, reward=reward, precisions=args.precisions)


def sweep(problem: Problem) -> tuple[SearchResult, dict[str, float]]:
    """Every policy of the space, evaluated (or read back from the cache), as a SearchResult."""
    layers = problem.layers()
    space = list(itertools.product(*(problem.choices(n) for n in layers)))
    result = SearchResult(agent="ground-truth", target=problem.evaluator.device.name)
    begin, new_time = time.perf_counter(), 0.0
    runs_before = problem.evaluator.runs
    for i, combo in enumerate(space):
        policy = dict(zip(layers, combo, strict=True))
        runs = problem.evaluator.runs
        start = time.perf_counter()
        metrics = problem.evaluate(policy)
        wall = time.perf_counter() - start
        if problem.evaluator.runs > runs:
            new_time += wall
        result.trials.append(
            Trial(i, policy, metrics, problem.reward(metrics), metrics.fidelity, wall)
        )
        if (i + 1) % 25 == 0 or i + 1 == len(space):
            elapsed = time.perf_counter() - begin
            eta = elapsed / (i + 1) * (len(space) - i - 1)
            print(
                f"ground truth: {i + 1}/{len(space)} ({elapsed:.0f} s, ETA {eta:.0f} s)", flush=True
            )
    new = problem.evaluator.runs - runs_before
    stats = {
        "policies": len(space),
        "new_evaluations": new,
        "seconds_per_new": new_time / new if new else math.nan,
        "wall_s": time.perf_counter() - begin,
    }
    return result, stats


# ------------------------------------------------------------------------------------- agents
def run_agent(args: Args, cache: Path, agent: str, budget: int, seed: int) -> dict[str, Any]:
    problem = make_problem(args, cache)
    kwargs: dict[str, Any] = {}
    if agent == "ppo" and args.ppo_timesteps is not None:
        kwargs["timesteps"] = args.ppo_timesteps
    start = time.perf_counter()
    result = search(problem, budget=budget, seed=seed, agent=agent, **kwargs)
    return {
        "result": result,
        "wall_s": time.perf_counter() - start,
        "fresh_runs": problem.evaluator.runs,  # fine-tunings not found in the cache
    }


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); all three equal for one value."""
    if len(values) == 1:
        return (values[0],) * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarise(
    runs: list[dict[str, Any]], best: float, true_volume: float, ref: Sequence[float]
) -> dict[str, Any]:
    regrets, found, ratios, walls, real = [], [], [], [], []
    for r in runs:
        result = r["result"]
        top = result.best
        reward = top.reward if top is not None else -math.inf
        regrets.append(best - reward if math.isfinite(reward) else math.inf)
        found.append(reward >= best - 1e-12)
        ratios.append(front_volume(result, ref) / true_volume if true_volume > 0 else math.nan)
        walls.append(r["wall_s"])
        real.append(len(result.real_trials))
    return {
        "regret": quartiles(regrets),
        "found": sum(found) / len(found),
        "hv": quartiles(ratios),
        "wall_s": statistics.median(walls),
        "real": statistics.median(real),
        "fresh_runs": sum(r["fresh_runs"] for r in runs),
        "runs": len(runs),
    }


# --------------------------------------------------------------------------------------- plot
def plot(path: Path, summary: dict[tuple[str, int], dict[str, Any]], args: Args) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    ax = fig.add_subplot()
    for agent in args.agents:
        med = [summary[(agent, b)]["regret"][1] for b in args.budgets]
        lo = [summary[(agent, b)]["regret"][0] for b in args.budgets]
        hi = [summary[(agent, b)]["regret"][2] for b in args.budgets]
        (line,) = ax.plot(args.budgets, med, marker="o", label=agent)
        ax.fill_between(args.budgets, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.budgets, [str(b) for b in args.budgets])
    ax.set_xlabel("budget (real evaluations)")
    ax.set_ylabel("regret (true best reward - agent's best)")
    ax.set_title(
        f"{args.model} on {args.dataset}: regret against budget "
        f"(median, IQR band; {args.seeds} seeds)"
    )
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def write_csv(path: Path, truth: SearchResult) -> None:
    import csv

    front = {t.number for t in truth.pareto}
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["policy", "reward", "loss_delta", "speedup", "memory_ratio", "pareto"])
        for t in truth.trials:
            m = t.metrics
            policy = " ".join(t.policy.values())
            writer.writerow(
                [policy, t.reward, m.loss_delta, m.speedup, m.memory_ratio, t.number in front]
            )


# ------------------------------------------------------------------------------------- report
def verdict(summary: dict[tuple[str, int], dict[str, Any]], args: Args) -> list[str]:
    """Sentences read off the table: which agent leads at each budget, against random."""
    lines = []
    for b in args.budgets:
        low = min(summary[(a, b)]["regret"][1] for a in args.agents)
        leads = [a for a in args.agents if summary[(a, b)]["regret"][1] <= low + 1e-12]
        text = f"Budget {b}: lowest median regret ({low:.4f}) {', '.join(leads)}"
        if len(leads) > 1:  # a tie on the median: the share of runs finding the best decides
            top = max(summary[(a, b)]["found"] for a in leads)
            firsts = [a for a in leads if summary[(a, b)]["found"] >= top]
            text += f"; of those, most runs finding the true best ({top:.0%}): {', '.join(firsts)}"
        if "random" in args.agents and "random" not in leads:
            text += f"; random {summary[('random', b)]['regret'][1]:.4f}"
        lines.append(text + ".")
    top = args.budgets[-1]
    most = [a for a in args.agents if summary[(a, top)]["found"] > 0.5]
    lines.append(
        f"At budget {top}, agents that found the true best in most runs: "
        + (", ".join(most) if most else "none")
        + "."
    )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.quick:
        args.precisions, args.budgets, args.seeds = ["fp32", "bf16"], [4, 8], 1
        args.steps = args.steps or 5
        args.ppo_timesteps = args.ppo_timesteps or 128
    if args.plot is None and args.write_docs and not args.quick:  # the docs' own plot
        args.plot = PLOT.with_name(f"{PLOT.stem}{dataset_suffix(args.dataset, '-')}{PLOT.suffix}")
    cache = args.cache_dir or default_cache_dir()
    os.environ["AUTOPREC_CACHE_DIR"] = str(cache)  # the sensitivity tables live there too
    print(f"cache: {cache}", flush=True)

    truth, stats = sweep(make_problem(args, cache))
    best_trial = truth.best
    best = best_trial.reward
    tol = args.accuracy_tolerance
    ref = reference_point(truth, tol)
    true_volume = front_volume(truth, ref)
    diverged = sum(t.metrics.diverged for t in truth.trials)
    all_rewards = sorted(t.reward for t in truth.trials)
    rewards = (all_rewards[-1], statistics.median(all_rewards), all_rewards[0])
    ties = sum(r >= best - 1e-12 for r in all_rewards)
    if args.csv is not None:
        write_csv(args.csv, truth)

    summary: dict[tuple[str, int], dict[str, Any]] = {}
    for agent in args.agents:
        for budget in args.budgets:
            runs = [run_agent(args, cache, agent, budget, s) for s in range(args.seeds)]
            summary[(agent, budget)] = summarise(runs, best, true_volume, ref)
            s = summary[(agent, budget)]
            print(
                f"{agent} budget {budget}: median regret {s['regret'][1]:.4f}, found "
                f"{s['found']:.0%}, hypervolume {s['hv'][1]:.2f}, {s['wall_s']:.1f} s/run",
                flush=True,
            )
    if args.plot is not None:
        plot(docs_output(args.plot), summary, args)

    rows = []
    for agent in args.agents:
        for budget in args.budgets:
            s = summary[(agent, budget)]
            q1, med, q3 = s["regret"]
            h1, hmed, h3 = s["hv"]
            rows.append(
                [
                    agent,
                    str(budget),
                    str(s["runs"]),
                    f"{med:.4f}",
                    f"{q1:.4f} .. {q3:.4f}",
                    f"{s['found']:.0%}",
                    f"{hmed:.3f}",
                    f"{h1:.3f} .. {h3:.3f}",
                    f"{s['real']:g}",
                    f"{s['wall_s']:.1f}",
                    str(s["fresh_runs"]),
                ]
            )
    best_policy = " ".join(best_trial.policy.values())
    m = best_trial.metrics
    figure = []
    if args.plot is not None:
        plot_ref = os.path.relpath(args.plot.resolve(), args.docs.resolve().parent)
        figure = [f"![regret against budget]({plot_ref})", ""]
    body = "\n".join(
        [
            f"## Agents against the true optimum ({args.model} on {args.dataset}, "
            f"{len(truth.trials)} policies)",
            "",
            provenance(invocation(__file__)),
            f"Ground truth: all {stats['policies']} policies of {args.model} "
            f"({', '.join(args.precisions)} per tunable layer) at `short` fidelity on "
            f"{args.dataset}, target {args.target}, through one evaluator cache "
            f"({stats['new_evaluations']} evaluated in this run at "
            f"{stats['seconds_per_new']:.2f} s each, the rest read back; {diverged} diverged). "
            f"True best reward {best:.4f}: `{best_policy}` (layers in execution order; loss "
            f"delta {m.loss_delta:+.4f}, speedup {m.speedup:.2f}x, memory {m.memory_ratio:.2f}x). "
            f"True Pareto front: {len(truth.pareto)} policies, hypervolume {true_volume:.4g}, "
            f"objectives (loss_delta, -speedup, memory_ratio) minimised, reference point "
            f"({ref[0]:g}, {ref[1]:.4g}, {ref[2]:.4g}): the accuracy tolerance, and the worst "
            "speedup and memory ratio of the space plus a tenth of their range. Rewards over "
            f"the space: best {best:.4f}, median {rewards[1]:.4f}, worst {rewards[2]:.4f}; "
            f"{ties} of the {len(all_rewards)} have the best reward. Costs are the cost "
            f"model's for {args.target} at batch {args.cost_batch_size}. Each agent run: "
            "`autoprec.agents.search` with default options"
            + (f" (ppo timesteps {args.ppo_timesteps})" if args.ppo_timesteps else "")
            + f", reward weights and tolerance {tol:g}, on a fresh evaluator over the same "
            "cache. Regret: true best reward minus the run's best; found: share of runs whose "
            "best is the true best; HV: the run's Pareto front's hypervolume over the true "
            "front's; fresh fine-tunings: evaluations the cache did not hold (0 = every "
            "agent evaluation was a cache hit). `greedy` is deterministic: its seeds repeat "
            "one run.",
            "",
            md_table(
                [
                    "agent",
                    "budget",
                    "runs",
                    "median regret",
                    "regret IQR",
                    "found true best",
                    "median HV ratio",
                    "HV ratio IQR",
                    "real evaluations",
                    "s per run",
                    "fresh fine-tunings",
                ],
                rows,
            ),
            "",
            *verdict(summary, args),
            "",
            *figure,
        ]
    )
    print(body)
    if args.write_docs:
        write_section("ground_truth" + dataset_suffix(args.dataset), body, path=args.docs)
    return {"truth": truth, "stats": stats, "summary": summary, "best": best}


if __name__ == "__main__":
    main()
