"""The searched export against the hand rules, judged by full training (issue 36's proof).

The ground truth of experiments/full_training.py (the same options, the same cached runs):
every policy of its set -- the target's hand rules (``--hand-rules``), the uniform formats and
random per-layer mixes -- trained ``--seeds`` times for ``--steps`` steps. Here each is also
priced (the evaluator's cost model at ``--train-shape``: speedup and memory against fp32) and
scored by the search's reward with its *full-training* loss delta (``--truth``) in place of the
fine-tuning one (:class:`autoprec.evaluate.RewardConfig`, default weights and tolerance).

Then each agent of ``--agents`` searches with ``--budget`` real evaluations at the evaluator's
default fidelity (``autoprec.agents.search`` on a fresh evaluator over the same cache, so its
surrogate learns only from its own evaluations, as in ``autoprec search``), and its best policy
is trained like the ground truth. The report says, per policy, its speed, memory, full-training
loss delta per seed and reward, and for each agent's export whether it beats every hand rule:
at least as fast under the cost model and a final loss no worse, or a higher reward.

    python experiments/frontier.py --model llama --dataset python-text --target b200 \\
        --train-shape llama3-8b --optimizer adamw --lr 1e-3 --hand-rules \\
        --init-checkpoint experiments/results/lm/llama-python-text-fp32.pt --write-docs
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import full_training as ft
from benchlib import md_table, parse_args, publish
from benchlib import provenance as provenance_lines

from autoprec.agents import search
from autoprec.cache import cache_dir as default_cache_dir
from autoprec.evaluate import RewardConfig
from autoprec.evaluate.reward import (
    DEFAULT_WEIGHTS,
    chinchilla_accuracy_weight,
    chinchilla_tokens,
)

DEFAULT_AGENTS = ["ppo", "tpe", "greedy", "random"]
#: Llama 3 8B's parameters (Meta's model card: 8.03B), the production model of ``llama3-8b``.
LLAMA3_8B_PARAMS = 8.03e9
#: Training lengths (tokens) of the table of the best policy by training length: from a short
#: fine-tune to Llama 3's 15T tokens.
LENGTHS = (1e9, 1e10, 1e11, 1e12, 15e12)


@dataclass
class Args(ft.Args):
    agents: list[str] = field(default_factory=lambda: list(DEFAULT_AGENTS))
    budget: int = field(default=16, metadata={"help": "real evaluations per agent"})
    search_seed: int = 0
    truth: str = field(
        default="final_loss",
        metadata={"help": "the full-training delta judged: final_loss, run_loss or val_loss"},
    )
    fidelities: list[str] = field(default_factory=list)
    w_accuracy: float = field(
        default=DEFAULT_WEIGHTS["accuracy"],
        metadata={"help": "the reward's accuracy weight (the search's --w-accuracy)"},
    )
    exports_dir: Path | None = field(
        default=None, metadata={"help": "write each agent's export here (<agent>.yaml)"}
    )
    params: float = field(
        default=LLAMA3_8B_PARAMS,
        metadata={"help": "the production model's parameters, for Chinchilla's loss fit"},
    )

    @property
    def reward(self) -> RewardConfig:
        return RewardConfig({"accuracy": self.w_accuracy})

    @property
    def section(self) -> str:
        weight = "" if self.w_accuracy == DEFAULT_WEIGHTS["accuracy"] else f"_w{self.w_accuracy:g}"
        return f"frontier_{self.slug}" + ft.dataset_suffix(self.dataset) + weight


def priced(problem: Any, assignment: dict[str, str]) -> Any:
    """The evaluator's metrics of ``assignment`` at its default fidelity (cached)."""
    return problem.evaluate(assignment)


def truth_reward(metrics: Any, loss_delta: float, reward: RewardConfig | None = None) -> float:
    """The search's reward (``reward``, default weights if None) with the full-training loss
    delta in place of the evaluator's."""
    return (reward or RewardConfig())(dataclasses.replace(metrics, loss_delta=loss_delta))


def row(
    name: str, metrics: Any, truth: dict, target: str, reward: RewardConfig | None = None
) -> dict[str, Any]:
    return {
        "policy": name,
        "speedup": metrics.speedup,
        "memory": metrics.memory_ratio,
        "fidelity_delta": metrics.loss_delta,
        "truth_delta": truth[target],
        "per_seed": truth["per_seed"][target],
        "reward": truth_reward(metrics, truth[target], reward),
        "metrics": metrics,
    }


def best_at(rows: dict[str, dict], weight: float) -> str:
    """The name of the policy of ``rows`` with the highest reward at accuracy weight ``weight``
    (the full-training delta as its loss delta)."""
    config = RewardConfig({"accuracy": weight})
    return max(rows, key=lambda n: truth_reward(rows[n]["metrics"], rows[n]["truth_delta"], config))


def overtaken_at(rows: dict[str, dict], weight: float, top: float = 1e4) -> float | None:
    """The smallest accuracy weight above ``weight`` at which the best policy at ``weight``
    is no longer the best (bisection: as the weight grows, the best policy's loss delta can
    only fall, so a policy overtaken stays overtaken); None if it is still the best at ``top``."""
    first = best_at(rows, weight)
    if best_at(rows, top) == first:
        return None
    low, high = weight, top
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if best_at(rows, mid) == first else (low, mid)
    return high


def by_length(rows: dict[str, dict], args: Args) -> tuple[list[list[str]], str]:
    """The best policy of the set by training length (the accuracy weight Chinchilla's fit
    gives a run of ``args.params`` parameters on that many tokens), and a sentence on the
    length beyond which the best policy at ``args.w_accuracy`` stops being the best."""
    table = []
    for tokens in LENGTHS:
        weight = chinchilla_accuracy_weight(args.params, tokens)
        best = rows[best_at(rows, weight)]
        table.append([f"{tokens:.2g}", f"{weight:.1f}", f"`{best['policy']}`",
                      f"{best['speedup']:.2f}", f"{best['truth_delta']:+.4f}"])  # fmt: skip
    first = rows[best_at(rows, args.w_accuracy)]
    weight = overtaken_at(rows, args.w_accuracy)
    if weight is None:
        return table, f"`{first['policy']}` stays the best at every accuracy weight."
    after = rows[best_at(rows, weight * 1.0001)]
    tokens = chinchilla_tokens(args.params, weight)
    return table, (
        f"`{first['policy']}`, the best at accuracy weight {args.w_accuracy:g}, stops being the "
        f"best at weight {weight:.1f}, where `{after['policy']}` ({after['speedup']:.2f}x, "
        f"{after['truth_delta']:+.4f}) overtakes it: by Chinchilla's fit, a "
        f"{args.params / 1e9:.2f}B-parameter model trained on more than {tokens:.2g} tokens."
    )


def dominates(mine: dict, rule: dict) -> bool:
    """At least as fast under the cost model and a full-training loss no worse, one of them
    strictly better."""
    no_worse = mine["speedup"] >= rule["speedup"] and mine["truth_delta"] <= rule["truth_delta"]
    return no_worse and (
        mine["speedup"] > rule["speedup"] or mine["truth_delta"] < rule["truth_delta"]
    )


def _same(mine: dict, rule: dict) -> bool:
    """The same policy (the same speed and the same full-training runs)."""
    seeds = mine.get("per_seed")
    return seeds is not None and mine["speedup"] == rule["speedup"] and seeds == rule["per_seed"]


def beats(mine: dict, rule: dict) -> bool:
    """Dominates ``rule``, or has a higher reward (the search's own criterion)."""
    return dominates(mine, rule) or mine["reward"] > rule["reward"]


def verdict(mine: dict, rules: dict[str, dict]) -> str:
    """Which rules the export dominates, which it beats by the reward only, which it does not."""
    if not rules:
        return "no hand rule applies"
    same = [n for n, r in rules.items() if _same(mine, r)]
    rules = {n: r for n, r in rules.items() if n not in same}
    won = [n for n, r in rules.items() if dominates(mine, r)]
    reward = [n for n, r in rules.items() if not dominates(mine, r) and beats(mine, r)]
    lost = [n for n, r in rules.items() if not beats(mine, r)]
    parts = [f"is {', '.join(n.removeprefix('rule ') for n in same)}"] if same else []
    parts.append(f"dominates {len(won)} of {len(rules)}")
    if reward:
        parts.append(
            "higher reward only than " + ", ".join(n.removeprefix("rule ") for n in reward)
        )
    parts.append(
        "beats every hand rule"
        if not lost
        else "loses to " + ", ".join(n.removeprefix("rule ") for n in lost)
    )
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    start = time.perf_counter()
    problem = ft.make_problem(args, cache)
    policies = ft.choose_policies(args, problem)
    print(f"{len(policies)} policies of {args.model} on {args.dataset}", flush=True)
    truth = ft.ground_truth(args, problem, policies, cache)
    exports: dict[str, dict] = {}
    for agent in args.agents:
        t = time.perf_counter()
        fresh = ft.make_problem(args, cache)
        fresh.reward = args.reward
        result = search(fresh, args.budget, seed=args.search_seed, agent=agent)
        best = result.best
        if best is None:
            print(f"{agent}: no real trial", flush=True)
            continue
        assignment = dict(best.policy)
        if args.exports_dir is not None:
            from autoprec.policy.io import save_policy

            Path(args.exports_dir).mkdir(parents=True, exist_ok=True)
            policy = result.policy_of(best, fresh.evaluator.spec.module)
            save_policy(policy, Path(args.exports_dir) / f"{agent}.yaml")
        runs = [ft.full_run(args, problem, assignment, s, cache) for s in range(args.seeds)]
        reference = truth["fp32"]["reference"]
        got = {
            args.truth: ft.delta(args.truth, runs, reference),
            "per_seed": {
                args.truth: [
                    ft.delta(args.truth, [r], [f]) for r, f in zip(runs, reference, strict=True)
                ]
            },
        }
        exports[agent] = row(f"{agent} export", best.metrics, got, args.truth, args.reward)
        exports[agent]["policy_map"] = assignment
        exports[agent]["search_s"] = time.perf_counter() - t
        print(f"{agent}: {exports[agent]['search_s']:.0f} s", flush=True)
    rows = {
        n: row(n, priced(problem, a), truth[n], args.truth, args.reward)
        for n, a in policies.items()
    }
    wall = time.perf_counter() - start
    body = report(args, policies, rows, exports, truth, wall, problem.evaluator.cost_batch_size)
    publish(args.section, body, args, path=args.docs)
    return {"rows": rows, "exports": exports}


def _fmt(r: dict) -> list[str]:
    seeds = ", ".join(f"{d:+.4f}" for d in r["per_seed"])
    return [
        f"`{r['policy']}`",
        f"{r['speedup']:.3f}",
        f"{r['memory']:.3f}",
        f"{r['fidelity_delta']:+.4f}",
        f"{r['truth_delta']:+.4f} ({seeds})",
        f"{r['reward']:.3f}",
    ]


def label(name: str, policy: dict[str, str]) -> str:
    """A policy's short name: the rule's or the file's, ``uniform nvfp4``, or the count of
    each format."""
    if name.startswith(("rule ", "file ")):
        return name
    counts = Counter(policy.values())
    if len(counts) == 1:
        return f"uniform {next(iter(counts))}"
    return "mix " + " ".join(f"{p}:{n}" for p, n in sorted(counts.items()))


def dominators(rows: dict, rules: dict) -> list[list[str]]:
    """Per rule: how many of the set's policies dominate it, and the fastest of them."""
    out = []
    for name, rule in rules.items():
        better = [r for r in rows.values() if dominates(r, rule)]
        fastest = max(better, key=lambda r: r["speedup"], default=None)
        best = "-" if fastest is None else f"`{fastest['policy']}` ({fastest['speedup']:.2f}x, "
        best += "" if fastest is None else f"{fastest['truth_delta']:+.4f})"
        out.append([f"`{name}`", str(len(better)), best])
    return out


def report(
    args: Args, policies: dict, rows: dict, exports: dict, truth: dict, wall: float,
    cost_batch: int,
) -> str:  # fmt: skip
    rows = {n: {**r, "policy": label(n, policies[n])} for n, r in rows.items()}
    rules = {n: r for n, r in rows.items() if n.startswith("rule ")}
    uniform = {
        n: r
        for n, r in rows.items()
        if len(set(policies[n].values())) == 1 and n not in rules
        and all(policies[n] != policies[m] for m in rules)
    }  # fmt: skip
    best_mix = max(rows.values(), key=lambda r: r["reward"])
    judged = f"full-training {ft.TARGET_LABELS[args.truth]} delta (per seed)"
    header = ["policy", "speedup", "memory", "fidelity loss delta", judged, "reward"]
    listed = [*rules.values(), *uniform.values()]
    if all(best_mix is not r for r in listed):
        listed.append(best_mix)
    verdicts = []
    for agent, r in exports.items():
        verdicts.append([agent, f"{r['search_s']:.0f}", *_fmt(r)[1:], verdict(r, rules)])
    fp32 = truth["fp32"]["reference"]
    lines = [
        f"## The export against the hand rules, by full training ({args.model} on {args.dataset}"
        + ("" if "_w" not in args.section else f", accuracy weight {args.w_accuracy:g}")
        + ")",
        "",
        provenance_lines(ft.invocation(__file__)),
        f"{len(policies)} policies (the {args.target} hand rules, uniform formats and random "
        f"mixes of {', '.join(args.precisions)}) trained {ft.training_words(args)}, "
        f"{args.seeds} seeds; fp32's {ft.TARGET_LABELS[args.truth]} per seed: "
        + ", ".join(f"{r[args.truth]:.4f}" for r in fp32)
        + f". Full-training delta: {ft.TARGET_LABELS[args.truth]} (relative, mean over seeds)"
        + f". Speed and memory: the cost model on {args.target} at "
        f"{args.train_shape or 'the fine-tuning shape'}, batch {cost_batch} (against fp32; "
        "`autoprec search` costs a named shape at batch 1). Reward: the search's "
        f"(accuracy weight {args.w_accuracy:g}), "
        "with that full-training delta in place of the evaluator's. "
        "Fidelity loss delta: the evaluator's at its default fidelity.",
        "",
        md_table(header, [_fmt(r) for r in listed]),
        "",
        f"Best policy of the set under this reward: `{best_mix['policy']}` "
        f"({best_mix['reward']:.3f}). Policies of the set that dominate each rule (at least "
        "as fast under the cost model and a full-training delta no worse, one strictly):",
        "",
        md_table(["rule", "dominated by", "the fastest of them"], dominators(rows, rules)),
    ]
    lengths, crossing = by_length(rows, args)
    lines += [
        "",
        "The best policy of the set by training length: the reward's accuracy weight that prices "
        "a relative loss increase as the extra tokens that recover it, by Chinchilla's loss fit "
        f"for a {args.params / 1e9:.2f}B-parameter model "
        "(`autoprec.evaluate.reward.chinchilla_accuracy_weight`; the loss deltas are these "
        f"{args.steps}-step runs', taken as the run's relative loss increase at every length). "
        + crossing,
        "",
        md_table(["tokens", "accuracy weight", "best policy", "speedup", "delta"], lengths),
    ]
    if verdicts:
        lines += [
            "",
            f"Each agent searched with {args.budget} real evaluations (seed "
            f"{args.search_seed}); its export trained like the ground truth:",
            "",
            md_table(
                ["agent", "search (s, this run)", *header[1:], "against the hand rules"], verdicts
            ),
        ]
    lines += ["", f"Wall time of this run: {wall:.0f} s (cached runs are read back)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
