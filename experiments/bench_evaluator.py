"""Evaluator cost per fidelity, signal against noise, and how well the surrogate ranks policies.

Target h100-sxm, torchvision models at 32x32, a fresh cache folder per (model, dataset).

1. Wall time of the fp32 warm start + reference, and of one evaluation at each fidelity
   (surrogate: the first call, which measures the sensitivity table, and a later call).
2. Gap against spread: at `short` fidelity, the loss delta of every uniform policy for several
   seeds (each seed its own warm start and batches): mean and standard deviation over seeds.
3. Repeatability: N random policies evaluated at `short` on two batch orders from the same warm
   start (`batch_seed`); Spearman between the two. A score that ranks policies differently
   when only the order of the fine-tuning batches changes measures that order, not precision.
4. The surrogate against `short` on N held-out random policies, predicted before they are
   evaluated, (a) fitted only on the uniform policies, (b) refit, as in a search, on the
   uniform policies plus N other random policies evaluated for real. The random policies of the
   benchmark are drawn with seeds of their own (1, 2), not the ones the surrogate's settings
   were studied on.

    python experiments/bench_evaluator.py --write-docs
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass, field

import numpy as np
from benchlib import invocation, parse_args, provenance, timed, write_section
from scipy.stats import spearmanr

from autoprec.agents.base import layer_choices
from autoprec.data import load_dataset_for
from autoprec.defaults import DEFAULT_DATASET
from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.layers import tunable_layers
from autoprec.models import load_model

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
OTHER_ORDER = 1  # batch_seed of the repeat measurement


@dataclass
class Args:
    rank_models: list[str] = field(default_factory=lambda: ["tinycnn", "resnet18"])
    timing_models: list[str] = field(default_factory=lambda: ["tinycnn", "resnet18", "resnet50"])
    datasets: list[str] = field(default_factory=lambda: [DEFAULT_DATASET, "digits"])
    steps: list[int] = field(
        default_factory=lambda: [10, 30], metadata={"help": "short steps compared"}
    )
    seeds: int = 3
    policies: int = 30
    workers: int = field(
        default=2,
        metadata={"help": "worker processes of the random-policy evaluations (0: this one)"},
    )
    target: str = "h100-sxm"
    space: str = field(
        default="runnable",
        metadata={
            "help": "random policies over the precisions each layer runs at on the target (the "
            "search's action masks: no fp8 convolution), or 'all' five on every layer (runs "
            "before 2026-12-03 did, when fp8 on a convolution was still emulated as fp8)"
        },
    )
    cache_root: str | None = field(
        default=None,
        metadata={
            "help": "keep the evaluations of steps 2-4 in DIR/<model>-<dataset> (a rerun reuses "
            "them); the wall times of step 1 always use a fresh folder"
        },
    )
    section: str = field(
        default="bench_evaluator",
        metadata={
            "help": "the docs section --write-docs replaces: a partial rerun (fewer models, "
            "datasets or steps) can go to a section of its own, next to the full tables"
        },
    )
    write_docs: bool = False


def setup(name: str, dataset: str, root: str | None = None):
    size = None if name in ("tinycnn", "mlp") else 32
    spec = load_model(name, num_classes=10, image_size=size)
    data = load_dataset_for(spec, dataset, seed=0)
    if root is None:
        cache = tempfile.mkdtemp(prefix="autoprec-bench-")
    else:
        cache = os.path.join(root, f"{name}-{dataset}")
        os.makedirs(cache, exist_ok=True)
    os.environ["AUTOPREC_CACHE_DIR"] = cache  # sensitivity tables too: nothing reused
    return spec, data, cache


def random_policies(choices: dict[str, list[str]], n: int, seed: int) -> list[dict[str, str]]:
    """``n`` policies, each layer's precision uniform over its ``choices``."""
    rng = np.random.default_rng(seed)
    return [{layer: str(rng.choice(c)) for layer, c in choices.items()} for _ in range(n)]


def layer_space(spec, evaluator: Evaluator, space: str) -> dict[str, list[str]]:
    """Each tunable layer's precisions: all five, or those it runs at on the target."""
    layers = [name for name, _ in tunable_layers(spec.module)]
    if space == "all":
        return {layer: list(PRECISIONS) for layer in layers}
    if space != "runnable":
        raise SystemExit(f"--space must be runnable or all, got {space!r}")
    return layer_choices(evaluator, layers, PRECISIONS)


def rho(a, b) -> float:
    return float(spearmanr(a, b).statistic)


def main() -> None:
    args = parse_args(Args, __doc__.splitlines()[0])
    cost_rows, noise_rows, rank_rows = [], [], []
    for name in args.timing_models:
        for dataset in args.datasets:
            spec, data, cache = setup(name, dataset)
            ev = Evaluator(spec, data, target=args.target, cache_dir=cache)
            t_ref = timed(ev.reference)
            t_short = timed(lambda ev=ev: ev.evaluate("bf16"))
            t_full = timed(lambda ev=ev: ev.evaluate("bf16", fidelity="full"))
            t_sur_first = timed(lambda ev=ev: ev.evaluate("fp16", fidelity="surrogate"))
            t_sur = timed(lambda ev=ev: ev.evaluate("fp8", fidelity="surrogate"))
            n_layers = len(list(tunable_layers(spec.module)))
            cost_rows.append(
                f"| {name} | {dataset} | {n_layers} | {t_ref:.1f} | {t_short:.1f} "
                f"| {t_full:.1f} | {t_sur_first:.1f} | {t_sur * 1e3:.1f} |"
            )
            print(cost_rows[-1], flush=True)

    for name in args.rank_models:
        for dataset in args.datasets:
            spec, data, cache = setup(name, dataset, args.cache_root)
            evaluators = [
                Evaluator(
                    spec, data, target=args.target, cache_dir=cache, config=EvaluatorConfig(seed=s)
                )
                for s in range(args.seeds)
            ]
            deltas = {p: [e.evaluate(p).loss_delta for e in evaluators] for p in PRECISIONS}
            cells = []
            for p in PRECISIONS[1:]:
                d = deltas[p]
                spread = statistics.stdev(d) if len(d) > 1 else 0.0
                snr = abs(statistics.mean(d)) / spread if spread > 0 else float("inf")
                cells.append(f"{statistics.mean(d):+.4f} ± {spread:.4f} ({snr:.1f})")
            ref = evaluators[0].reference()
            noise_rows.append(
                f"| {name} | {dataset} | {ref.loss:.3f} | {ref.fp32_accuracy:.3f} | "
                f"{args.seeds} | " + " | ".join(cells) + " |"
            )
            print(noise_rows[-1], flush=True)

            choices = layer_space(spec, evaluators[0], args.space)
            train = random_policies(choices, args.policies, seed=1)
            test = random_policies(choices, args.policies, seed=2)
            for steps in args.steps:
                ev = Evaluator(
                    spec,
                    data,
                    target=args.target,
                    cache_dir=cache,
                    config=EvaluatorConfig(steps=steps),
                )
                ev.reference()
                ev.start_workers(args.workers)  # the real runs below go side by side
                ev.prefetch([*PRECISIONS, *train, *test])
                uniform = [ev.evaluate(p) for p in PRECISIONS]  # fits the surrogate
                if any(m.diverged for m in uniform):
                    raise SystemExit(f"{name} on {dataset}: a uniform policy diverged")
                only_uniform = [ev.evaluate(p, fidelity="surrogate").loss_delta for p in test]
                for p in train:
                    ev.evaluate(p)
                refit = [ev.evaluate(p, fidelity="surrogate").loss_delta for p in test]
                measured = [ev.evaluate(p).loss_delta for p in test]
                ev.stop_workers()
                other = Evaluator(
                    spec,
                    data,
                    target=args.target,
                    cache_dir=cache,
                    config=EvaluatorConfig(steps=steps, batch_seed=OTHER_ORDER),
                )
                other.reference()
                other.start_workers(args.workers)
                other.prefetch(test)
                repeat = [other.evaluate(p).loss_delta for p in test]
                other.stop_workers()
                rank_rows.append(
                    f"| {name} | {dataset} | {steps} | {args.policies} | "
                    f"{float(np.std(measured)):.5f} | {rho(measured, repeat):.2f} | "
                    f"{rho(only_uniform, measured):.2f} | {rho(refit, measured):.2f} |"
                )
                print(rank_rows[-1], flush=True)

    cfg = EvaluatorConfig()
    budget, copies = cfg.steps_by_fidelity, cfg.replicates_by_fidelity
    header = provenance(invocation(__file__)) + (
        f"Target {args.target}; torchvision models at 32x32; a fresh cache folder per model and "
        f"dataset. Evaluator defaults: {cfg.warm_start_steps} fp32 warm-start steps (SGD lr "
        f"{cfg.recipe.lr:g}, momentum 0.9) at batch {cfg.recipe.batch_size}; `short` = "
        f"{copies['short']} fine-tune(s) of {budget['short']} steps, `full` = {copies['full']} of "
        f"{budget['full']} (averaged), at batch {cfg.recipe.batch_size}, SGD lr "
        f"{cfg.resolved_finetune_lr:g}, momentum {cfg.momentum:g}; scored by the loss over the "
        "whole training split with the policy applied. The surrogate's sensitivity table is "
        "measured on the same warm start. The random policies' evaluations ran "
        + (
            f"{args.workers} at a time in worker processes"
            if args.workers > 1
            else "one at a time in the benchmark's process"
        )
        + "."
    )
    body = "\n".join(
        [
            header,
            "",
            "Wall time per evaluation (seconds; the reference includes training the warm start):",
            "",
            "| model | dataset | layers | warm start + fp32 reference | short | full | "
            "surrogate, first call | surrogate, later call (ms) |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
            *cost_rows,
            "",
            "Loss delta against fp32 at `short` fidelity, mean ± standard deviation over seeds "
            "(each seed its own warm start and batches; in brackets |mean| / sd). fp32 is 0 by "
            "construction; its training loss and validation accuracy (seed 0) are given:",
            "",
            "| model | dataset | fp32 loss | fp32 accuracy | seeds | tf32 | bf16 | fp16 | fp8 |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            *noise_rows,
            "",
            "Random policies (each layer's precision uniform over "
            + (
                "fp32, tf32, bf16, fp16, fp8"
                if args.space == "all"
                else "the precisions it runs at on the target, the search's action masks: "
                "fp32, tf32, bf16, fp16 for a convolution, fp8 too for a Linear torchao takes"
            )
            + "), "
            "at `short` with the given steps: the spread (sd) of their loss deltas; "
            "repeatability, the Spearman correlation of their loss deltas on two batch orders "
            "from one warm start; and the surrogate's Spearman correlation with the measured "
            "deltas of held-out policies, fitted on the 5 uniform policies only, and refit on "
            "those plus as many other random policies as there are held-out ones:",
            "",
            "| model | dataset | steps | policies | sd of loss delta | repeatability | "
            "surrogate, uniform fit | surrogate, refit |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
            *rank_rows,
            "",
        ]
    )
    print(body)
    if args.write_docs:
        title = "Policy evaluator"
        if args.section != Args.section:
            title += (
                f": {', '.join(args.rank_models)} on {', '.join(args.datasets)} at "
                f"{', '.join(map(str, args.steps))} steps (partial rerun)"
            )
        write_section(args.section, f"## {title}\n\n{body}")


if __name__ == "__main__":
    main()
