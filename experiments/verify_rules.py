"""The search's export against fp32 and every hand rule, by `autoprec verify` (issue 36's proof).

A user's check, run as a user runs it: ``autoprec verify EXPORT --arms fp32,RULES...`` (the
rule files a search with ``--pareto-dir`` writes under ``rules/``), every arm trained from the
same checkpoint with the same batches per seed, over ``--seeds`` seeds, with the learning
curves (``--plot``). Everything after ``--`` is passed to `autoprec verify` as given; this
script adds the arms and the plot, reads back the ``VerifyResult`` (the same runs: a repeated
command trains nothing again) and prices each arm with the cost model the search used
(``--target`` at ``--train-shape``). The table: each arm's final loss over the seeds, its
delta to fp32, its speedup and memory under the cost model and its reward at
``--w-accuracy``; the verdict says, per rule, whether the export dominates it (at least as
fast and a verified final loss no worse, one strictly) or beats it by the reward only.

    python experiments/verify_rules.py --policy runs/lm/best_policy.yaml \\
        --rules-dir runs/lm/pareto/rules --target b200 --train-shape llama3-8b \\
        --w-accuracy 82.9 --write-docs -- --model llama-small --dataset python-text \\
        --steps 80 --batch-size 16 --optimizer adamw --lr 3e-4 --mode emulate \\
        --checkpoint experiments/results/lm/llama-small-python-text-fp32.pt --no-mlflow
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import benchlib
from benchlib import DOCS, invocation, md_table, parse_args, provenance, publish
from frontier import dominates, verdict

from autoprec.evaluate import RewardConfig
from autoprec.evaluate.reward import DEFAULT_WEIGHTS


@dataclass
class Args:
    policy: Path = field(default=Path("best_policy.yaml"), metadata={"help": "the export"})
    rules_dir: Path = field(
        default=Path("pareto/rules"), metadata={"help": "the hand rules' policy files"}
    )
    target: str = "b200"
    train_shape: str | None = None
    w_accuracy: float = field(
        default=DEFAULT_WEIGHTS["accuracy"], metadata={"help": "the reward's accuracy weight"}
    )
    out: Path = field(
        default=Path("verified.yaml"), metadata={"help": "the verified export (--out)"}
    )
    plot: Path | None = field(
        default=None, metadata={"help": "learning curves (default with --write-docs: docs/)"}
    )
    section: str = "verify_rules"
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """This script's options, and `autoprec verify`'s (after ``--``)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def verify_options(args: Args, passed: list[str], arms: list[Path]) -> dict[str, Any]:
    """`autoprec verify`'s parsed options, as its command line would give them."""
    from autoprec.cli.verify import verify as command

    argv = [str(args.policy), *passed, "--target", args.target, "--out", str(args.out)]
    argv += ["--arms", ",".join(["fp32", *map(str, arms)])]
    if args.plot is not None:
        argv += ["--plot", str(args.plot)]
    with command.make_context("verify", argv) as ctx:
        return dict(ctx.params)


def pricer(args: Args, o: dict[str, Any]) -> Any:
    """``policy -> (speedup, memory ratio)`` against fp32, by the cost model the evaluator of
    a search with ``--target`` and ``--train-shape`` uses."""
    from autoprec.evaluate import EvaluatorConfig
    from autoprec.evaluate.costing import CostEstimator
    from autoprec.evaluate.workload import Workload, production_spec
    from autoprec.hardware import get_device
    from autoprec.models import load_model

    workload = Workload(o["model_name"], o["dataset"], train_shape=args.train_shape).resolved()
    spec = load_model(o["model_name"])
    cost_spec = production_spec(spec, o["model_name"], None, args.train_shape)
    batch = EvaluatorConfig(cost_batch_size=workload.cost_batch_size).resolved_cost_batch_size
    costs = CostEstimator(get_device(args.target), cost_spec, batch, "native", spec.module)
    fp32_time, fp32_memory = costs.fp32

    def price(policy: Any) -> tuple[float, float]:
        time, memory = costs.estimate(policy.resolve(spec.module))
        return fp32_time / time, memory / fp32_memory

    return price


def rows_of(result: Any, price: Any, reward: RewardConfig) -> dict[str, dict[str, Any]]:
    """Per arm: its final loss, delta to fp32, per-seed losses, speed, memory and reward."""
    fp32 = result.arm("fp32")
    rows = {}
    for arm in result.arms:
        speedup, memory = price(arm.policy)
        delta = arm.loss_mean / fp32.loss_mean - 1
        metrics = SimpleNamespace(
            diverged=bool(arm.diverged), feasible=True, loss_delta=delta, speedup=speedup,
            memory_ratio=memory,
        )  # fmt: skip
        rows[arm.arm] = {
            "policy": arm.arm,
            "loss": f"{arm.loss_mean:.4f} ± {arm.loss_sd:.4f}",
            "truth_delta": delta,
            "per_seed": [r.final_loss for r in arm.runs],
            "speedup": speedup,
            "memory": memory,
            "reward": reward(metrics),
        }
    return rows


def arm_name(arm: str) -> str:
    """``rule <name>`` for a rule file, else the arm's own name."""
    return f"rule {Path(arm).stem}" if arm.endswith((".yaml", ".yml")) else arm


def main(argv: list[str] | None = None) -> dict[str, Any]:
    mine, passed = split_argv(list(sys.argv[1:] if argv is None else argv))
    args = parse_args(Args, __doc__.splitlines()[0], mine)
    if passed:  # the provenance line shows the whole command
        benchlib._ARGV.extend(["--", *passed])
    if args.plot is None and args.write_docs:
        args.plot = DOCS.parent / f"{args.section.replace('_', '-')}.png"
    arms = sorted(Path(args.rules_dir).glob("*.yaml"))
    if not arms:
        raise SystemExit(f"no hand-rule policy files in {args.rules_dir}")
    o = verify_options(args, passed, arms)
    from autoprec.cli.verify import verify_with_options

    result = verify_with_options(args.policy, o)
    reward = RewardConfig({"accuracy": args.w_accuracy})
    rows = {arm_name(k): v for k, v in rows_of(result, pricer(args, o), reward).items()}
    rules = {n: r for n, r in rows.items() if n.startswith("rule ")}
    mine = rows["policy"]
    table = [
        [
            f"`{n}`", r["loss"], f"{r['truth_delta']:+.4f}", f"{r['speedup']:.3f}",
            f"{r['memory']:.3f}", f"{r['reward']:.3f}",
            "" if n == "policy" else ("dominated" if dominates(mine, r) else ""),
        ]
        for n, r in rows.items()
    ]  # fmt: skip
    length = f"{o['steps']} steps" if o.get("steps") else f"{o.get('epochs') or 1} epoch(s)"
    body = "\n".join([
        f"## The export against fp32 and the hand rules, by `autoprec verify` ({o['model_name']})",
        "",
        provenance(invocation(__file__)),
        f"`autoprec verify {args.policy.name}` with arms fp32 and the {len(rules)} hand rules' "
        f"policy files ({args.rules_dir}): {len(result.config.seeds)} seeds, {length}, each "
        f"arm from the same weights and batches per seed, on {result.dataset}"
        + (f", from `{Path(o['checkpoint']).name}`" if o.get("checkpoint") else "")
        + f". Final loss: the mean training loss of the last 10% of steps (mean ± sd over the "
        f"seeds); delta: relative to fp32's. Speedup and memory: the cost model on "
        f"{args.target} at {args.train_shape or 'the training shape'}, against fp32. Reward: "
        f"the search's at accuracy weight {args.w_accuracy:g}, with the verified delta. "
        "Dominated: the export is at least as fast and its verified loss no worse, one "
        "strictly.",
        "",
        md_table(["arm", "final loss", "delta", "speedup", "memory", "reward", "by the export"],
                 table),  # fmt: skip
        "",
        f"The export (`policy`): {verdict(mine, rules)}. Verdict of `autoprec verify`: "
        f"{result.verdict} (loss delta {result.loss_delta:+.4f}); "
        f"{result.wall_time_s / 60:.1f} min of training in this run (runs found in the "
        "store are read back).",
        "",
        *([f"![learning curves]({args.plot.name})", ""] if args.plot else []),
    ])  # fmt: skip
    publish(args.section, body, args)
    return {"rows": rows, "result": result}


if __name__ == "__main__":
    main()
