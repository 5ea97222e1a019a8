"""Evaluator cost per fidelity, signal against noise, and how well the surrogate ranks policies.

For each model on digits (32x32 for torchvision models), target h100-sxm, a fresh cache:
1. wall time of the fp32 warm start + reference, and of one evaluation at each fidelity
   (surrogate: first call, which builds the sensitivity table, and a later call);
2. at `short` fidelity, the loss delta of every uniform policy for several seeds (each seed its
   own warm start and batches): mean and standard deviation across seeds, so the gap between
   fp32 (0 by construction) and the worst uniform policy can be read against the spread;
3. the surrogate's predicted loss delta for N random policies, taken BEFORE those policies are
   evaluated for real (it has only been fitted on the uniform policies of step 2), against the
   `short` fidelity's measured loss delta: Spearman rank correlation (target 0.7 on resnet18).

    python experiments/bench_evaluator.py --write-docs
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
from benchlib import provenance, write_section
from scipy.stats import spearmanr

from autoprec.data import load_dataset_for
from autoprec.evaluate import Evaluator
from autoprec.layers import tunable_layers
from autoprec.models import load_model

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: ["tinycnn", "resnet18"])
    timing_models: list[str] = field(default_factory=lambda: ["resnet50"])
    seeds: int = 3
    policies: int = 30
    target: str = "h100-sxm"
    write_docs: bool = False


def parse() -> Args:
    a = Args()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=a.models)
    p.add_argument(
        "--timing-models", nargs="*", default=a.timing_models, help="wall times only (step 1)"
    )
    p.add_argument("--seeds", type=int, default=a.seeds)
    p.add_argument("--policies", type=int, default=a.policies)
    p.add_argument("--write-docs", action="store_true")
    ns = p.parse_args()
    return Args(
        models=ns.models,
        timing_models=ns.timing_models,
        seeds=ns.seeds,
        policies=ns.policies,
        write_docs=ns.write_docs,
    )


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    args = parse()
    cost_rows, noise_rows, rank_rows = [], [], []
    for name in [*args.models, *args.timing_models]:
        size = None if name in ("tinycnn", "mlp") else 32
        spec = load_model(name, num_classes=10, image_size=size)
        data = load_dataset_for(spec, "digits", seed=0)
        cache = tempfile.mkdtemp(prefix="autoprec-bench-")
        os.environ["AUTOPREC_CACHE_DIR"] = cache  # sensitivity tables too: nothing reused
        evaluators = [
            Evaluator(spec, data, target=args.target, seed=s, cache_dir=cache)
            for s in range(args.seeds)
        ]
        ev = evaluators[0]
        _, t_ref = timed(ev.reference)
        _, t_short = timed(lambda ev=ev: ev.evaluate("bf16"))
        _, t_full = timed(lambda ev=ev: ev.evaluate("bf16", fidelity="full"))
        _, t_sur_first = timed(lambda ev=ev: ev.evaluate("fp16", fidelity="surrogate"))
        _, t_sur = timed(lambda ev=ev: ev.evaluate("fp8", fidelity="surrogate"))
        cost_rows.append(
            f"| {name} | {len(list(tunable_layers(spec.module)))} | {t_ref:.1f} | {t_short:.1f} "
            f"| {t_full:.1f} | {t_sur_first:.1f} | {t_sur * 1e3:.1f} |"
        )
        print(cost_rows[-1], flush=True)
        if name not in args.models:
            continue

        deltas = {p: [e.evaluate(p).loss_delta for e in evaluators] for p in PRECISIONS}
        cells = []
        for p in PRECISIONS[1:]:
            d = deltas[p]
            spread = statistics.stdev(d) if len(d) > 1 else 0.0
            cells.append(f"{statistics.mean(d):+.4f} ± {spread:.4f}")
        noise_rows.append(f"| {name} | {args.seeds} | " + " | ".join(cells) + " |")
        print(noise_rows[-1], flush=True)

        rng = np.random.default_rng(0)
        layers = [n for n, _ in tunable_layers(spec.module)]
        policies = [{n: str(rng.choice(PRECISIONS)) for n in layers} for _ in range(args.policies)]
        predicted = [ev.evaluate(p, fidelity="surrogate").loss_delta for p in policies]
        measured = [ev.evaluate(p).loss_delta for p in policies]
        rho = spearmanr(predicted, measured).statistic
        rank_rows.append(f"| {name} | {args.policies} | {rho:.2f} |")
        print(rank_rows[-1], flush=True)

    header = provenance(
        "python experiments/bench_evaluator.py "
        + " ".join(["--models", *args.models, "--timing-models", *args.timing_models])
        + f" --seeds {args.seeds} --policies {args.policies} --write-docs"
    ) + (
        f"Target {args.target}; digits (32x32 for torchvision models); a fresh cache per model; "
        "defaults: 200 fp32 warm-start steps (SGD lr 0.05, momentum 0.9), `short` = 30 and "
        "`full` = 200 fine-tune steps at batch 32 (SGD lr 0.01, no momentum), scored by the "
        "loss over the whole training split with the policy applied. The surrogate's "
        "sensitivity table is measured on the same warm start."
    )
    body = "\n".join(
        [
            header,
            "",
            "Wall time per evaluation (seconds; the reference includes training the warm start):",
            "",
            "| model | layers | warm start + fp32 reference | short | full | surrogate, first "
            "call | surrogate, later call (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *cost_rows,
            "",
            "Loss delta against fp32 at `short` fidelity, mean ± standard deviation over seeds "
            "(fp32 is 0 by construction):",
            "",
            "| model | seeds | tf32 | bf16 | fp16 | fp8 |",
            "|---|---:|---:|---:|---:|---:|",
            *noise_rows,
            "",
            "Surrogate (fitted only on the uniform policies above) against `short`, random "
            "policies:",
            "",
            "| model | policies | Spearman |",
            "|---|---:|---:|",
            *rank_rows,
            "",
        ]
    )
    print(body)
    if args.write_docs:
        write_section("bench_evaluator", f"## Policy evaluator\n\n{body}")


if __name__ == "__main__":
    main()
