"""The search's export against fp32 and every hand rule, by `autoprec verify` (issue 36's proof).

What ``autoprec verify EXPORT --arms fp32,RULES...`` does (the rule files a search with
``--pareto-dir`` writes under ``rules/``), through its library function
:func:`autoprec.verify.verify`: every arm trained from the same checkpoint with the same batches
per seed, over ``--seeds`` seeds, with the search's recipe under the options given (as the
command: :func:`autoprec.training.recipe.from_provenance`), the learning curves (``--plot``)
and the verified file (``--out``); runs found in the verification store are read back, not
trained again. Each arm is priced with the cost model the search used (``--target`` at
``--train-shape``). The table: each arm's final loss over the seeds, its
delta to fp32, its speedup and memory under the cost model and its reward at
``--w-accuracy`` (by default the search's: its export records the weight); the verdict says,
per rule, whether the export dominates it (at least as fast and a verified final loss no worse,
one strictly) or beats it by the reward only.

    python experiments/verify_rules.py --policy runs/lm/best_policy.yaml \\
        --rules-dir runs/lm/pareto/rules --target b200 --train-shape llama3-8b \\
        --w-accuracy 82.9 --model llama-small --dataset python-text --steps 80 \\
        --batch-size 16 --optimizer adamw --lr 3e-4 --mode emulate \\
        --checkpoint experiments/results/lm/llama-small-python-text-fp32.pt --write-docs
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchlib import DOCS, docs_output, invocation, md_table, parse_args, provenance, publish
from frontier import dominates, verdict

from autoprec.evaluate import RewardConfig
from autoprec.evaluate.reward import DEFAULT_WEIGHTS


@dataclass
class Args:
    policy: Path = field(default=Path("best_policy.yaml"), metadata={"help": "the export"})
    rules_dir: Path = field(
        default=Path("pareto/rules"), metadata={"help": "the hand rules' policy files"}
    )
    model: str = "tinycnn"
    dataset: str | None = None
    steps: int = 40
    seeds: int = 3
    batch_size: int = 32
    optimizer: str | None = field(default=None, metadata={"help": "default: the search's"})
    lr: float | None = field(default=None, metadata={"help": "default: the search's"})
    checkpoint: Path | None = field(default=None, metadata={"help": "every run starts here"})
    mode: str = "emulate"
    target: str = "b200"
    train_shape: str | None = None
    w_accuracy: float | None = field(
        default=None,
        metadata={
            "help": "the reward's accuracy weight (default: the search's, as its export "
            "records it, else the default)"
        },
    )
    out: Path = field(default=Path("verified.yaml"), metadata={"help": "the verified export"})
    plot: Path | None = field(
        default=None, metadata={"help": "learning curves (default with --write-docs: docs/)"}
    )
    section: str = "verify_rules"
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


def verify_config(args: Args, policy: Any, arms: list[Path]) -> Any:
    """`autoprec verify`'s config for these options: the search's recipe (the file's
    provenance, else the default) with the options given over it."""
    from autoprec.training.recipe import DEFAULT_RECIPE, from_provenance
    from autoprec.verify import VerifyConfig

    given = {"batch_size": args.batch_size, "optimizer": args.optimizer, "lr": args.lr}
    recipe = from_provenance(policy.provenance) or DEFAULT_RECIPE
    recipe = dataclasses.replace(recipe, **{k: v for k, v in given.items() if v is not None})
    return VerifyConfig(
        steps=args.steps, seeds=tuple(range(args.seeds)), arms=("fp32", *map(str, arms)),
        recipe=recipe, dataset=args.dataset, mode=args.mode,
    )  # fmt: skip


def pricer(args: Args) -> tuple[Any, int]:
    """``policy -> (speedup, memory ratio)`` against fp32 by the cost model the evaluator of a
    search with ``--target`` and ``--train-shape`` uses, and the batch it costs at."""
    from autoprec.evaluate import EvaluatorConfig
    from autoprec.evaluate.costing import CostEstimator
    from autoprec.evaluate.workload import Workload, production_spec
    from autoprec.hardware import get_device
    from autoprec.models import load_model

    workload = Workload(args.model, args.dataset, train_shape=args.train_shape).resolved()
    spec = load_model(args.model)
    cost_spec = production_spec(spec, args.model, None, args.train_shape)
    batch = EvaluatorConfig(cost_batch_size=workload.cost_batch_size).resolved_cost_batch_size
    costs = CostEstimator(get_device(args.target), cost_spec, batch, "native", spec.module)
    fp32_time, fp32_memory = costs.fp32

    def price(policy: Any) -> tuple[float, float]:
        time, memory = costs.estimate(policy.resolve(spec.module))
        return fp32_time / time, memory / fp32_memory

    return price, batch


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


def searched(policy: Any) -> str:
    """What the export's provenance says of the search that wrote it (one sentence), or ""."""
    pv = policy.provenance
    if "agent" not in pv:
        return ""
    parts = [f"`{pv['agent']}` with {pv.get('budget', '?')} real evaluations"]
    if "fidelity" in pv:
        parts.append(f"fidelity `{pv['fidelity']}`")
    if "dataset" in pv:
        size = f", {pv['max_samples']} examples" if "max_samples" in pv else ""
        parts.append(f"fine-tuned on {pv['dataset']}{size}")
    if "w_accuracy" in pv:
        length = f" (`--train-tokens {pv['train_tokens']:g}`)" if "train_tokens" in pv else ""
        parts.append(f"accuracy weight {pv['w_accuracy']:.1f}{length}")
    return "The export's search (its provenance): " + ", ".join(parts) + ". "


def arm_name(arm: str) -> str:
    """``rule <name>`` for a rule file, else the arm's own name."""
    return f"rule {Path(arm).stem}" if arm.endswith((".yaml", ".yml")) else arm


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from autoprec.policy.io import load_policy, save_policy
    from autoprec.tracking.plots import curves_figure, save_png
    from autoprec.verify import verify

    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.plot is None and args.write_docs:
        args.plot = DOCS.parent / f"{args.section.replace('_', '-')}.png"
    arms = sorted(Path(args.rules_dir).glob("*.yaml"))
    if not arms:
        raise SystemExit(f"no hand-rule policy files in {args.rules_dir}")
    policy = load_policy(args.policy)
    config = verify_config(args, policy, arms)
    result = verify(policy, args.model, config, target=args.target, checkpoint=args.checkpoint)
    save_policy(policy.replace(verification=result.section()), args.out)  # as the CLI does
    if args.plot is not None:
        title = f"{args.model} on {result.dataset}: {args.policy.name} against the hand rules"
        save_png(docs_output(args.plot), curves_figure(result, title))
    if args.w_accuracy is None:
        args.w_accuracy = float(policy.provenance.get("w_accuracy", DEFAULT_WEIGHTS["accuracy"]))
    reward = RewardConfig({"accuracy": args.w_accuracy})
    price, cost_batch = pricer(args)
    rows = {arm_name(k): v for k, v in rows_of(result, price, reward).items()}
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
    recipe = config.recipe
    body = "\n".join([
        f"## The export against fp32 and the hand rules, by `autoprec verify` ({args.model}, "
        f"accuracy weight {args.w_accuracy:.1f})",
        "",
        provenance(invocation(__file__)),
        searched(policy)
        + f"`autoprec verify {args.policy.name}` with arms fp32 and the {len(rules)} hand rules' "
        f"policy files ({args.rules_dir}): {args.seeds} seeds, {args.steps} steps at batch "
        f"{recipe.batch_size} ({recipe.optimizer}, lr {recipe.lr:g}), each arm from the same "
        f"weights and batches per seed, on {result.dataset}, {args.mode}d"
        + (f", from `{args.checkpoint.name}`" if args.checkpoint else "")
        + f". Final loss: the mean training loss of the last 10% of steps (mean ± sd over the "
        f"seeds); delta: relative to fp32's. Speedup and memory: the cost model on "
        f"{args.target} at {args.train_shape or 'the training shape'}, batch {cost_batch} (the "
        "search's costing batch), against fp32. Reward: "
        f"the search's at accuracy weight {args.w_accuracy:.4g}, with the verified delta. "
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
