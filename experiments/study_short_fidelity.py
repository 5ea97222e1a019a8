"""Choose the `short` fidelity's fine-tuning settings: signal (loss delta) against seed noise.

For each model and each fine-tuning setting (learning rate, momentum) and several seeds (each
seed its own fp32 warm start and fixed batches), evaluates every uniform policy at `short`
fidelity and reports each precision's loss delta against fp32 as mean ± standard deviation over
seeds, and the signal-to-noise ratio |mean| / sd of the worst precision. A setting is usable when
the deltas keep their sign and order from seed to seed (high ratio) and tf32, whose rounding is
tiny, stays near 0.

    python experiments/study_short_fidelity.py --models tinycnn resnet18 --write-docs
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from benchlib import provenance, write_section

from autoprec.data import load_dataset_for
from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.models import load_model

PRECISIONS = ("tf32", "bf16", "fp16", "fp8")
SETTINGS = ((0.05, 0.9), (0.01, 0.9), (0.01, 0.0), (0.002, 0.0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tinycnn", "resnet18"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--settings", nargs="+", default=[f"{a},{b}" for a, b in SETTINGS])
    p.add_argument(
        "--cache-dir",
        default=None,
        help="reuse this cache folder (evaluations already made there are read back)",
    )
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    settings = [tuple(float(v) for v in s.split(",")) for s in args.settings]
    rows = []
    cache = args.cache_dir or tempfile.mkdtemp(prefix="autoprec-study-")
    print(f"cache: {cache}", flush=True)
    os.environ["AUTOPREC_CACHE_DIR"] = cache
    for name in args.models:
        size = None if name in ("tinycnn", "mlp") else 32
        spec = load_model(name, num_classes=10, image_size=size)
        data = load_dataset_for(spec, "digits", seed=0)
        for lr, momentum in settings:
            deltas: dict[str, list[float]] = {p: [] for p in PRECISIONS}
            for seed in range(args.seeds):
                ev = Evaluator(
                    spec,
                    data,
                    target="h100-sxm",
                    cache_dir=cache,
                    config=EvaluatorConfig(
                        seed=seed, steps=args.steps, finetune_lr=lr, momentum=momentum
                    ),
                )
                for prec in PRECISIONS:
                    deltas[prec].append(ev.evaluate(prec).loss_delta)
            cells, snr = [], {}
            for prec in PRECISIONS:
                mean, sd = statistics.mean(deltas[prec]), statistics.stdev(deltas[prec])
                snr[prec] = abs(mean) / sd if sd > 0 else float("inf")
                cells.append(f"{mean:+.4f} ± {sd:.4f}")
            worst = max(PRECISIONS, key=lambda q: statistics.mean(deltas[q]))
            row = (
                f"| {name} | {lr:g} | {momentum:g} | "
                + " | ".join(cells)
                + f" | {worst} {snr[worst]:.1f} |"
            )
            print(row, flush=True)
            rows.append(row)
    if args.write_docs:
        body = [
            "## Choosing the `short` fidelity",
            "",
            provenance(
                "python experiments/study_short_fidelity.py "
                + " ".join(["--models", *args.models, "--seeds", str(args.seeds)])
                + " --write-docs"
            ),
            f"Target h100-sxm, digits, {args.steps} fine-tune steps at batch 32 from a 200-step "
            "fp32 warm start (lr 0.05, momentum 0.9); loss delta against fp32 over the training "
            f"split, mean ± sd over {args.seeds} seeds; SNR = |mean| / sd of the worst precision."
            + (
                " The evaluations were read back from the cache folder of the run that made "
                "them (`--cache-dir`)."
                if args.cache_dir
                else ""
            ),
            "",
            "| model | fine-tune lr | momentum | tf32 | bf16 | fp16 | fp8 | worst, SNR |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
            *rows,
        ]
        write_section("study_short_fidelity", "\n".join(body) + "\n")


if __name__ == "__main__":
    main()
