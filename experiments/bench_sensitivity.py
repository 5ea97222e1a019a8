"""Wall time of the per-layer sensitivity analysis, and how well the cheap method ranks layers.

For each model, at `autoprec analyze`'s default settings (digits resized to 32x32, 4 fixed
batches of 8, fp32 + 4 lower precisions, 30 fp32 warm-up steps), runs the full sweep (every
layer x every precision, one forward/backward each) and the Taylor estimate (one pass), with the
disk cache off, and reports their wall times and the Spearman rank correlation of the Taylor
scores against the sweep's (1 - gradient cosine, over layers, per precision). Target (issue 4):
the default method under 3 minutes for resnet50 on this 2-core CPU.

    python experiments/bench_sensitivity.py --write-docs
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np
from benchlib import provenance, publish
from scipy.stats import spearmanr

from autoprec.data import load_dataset_for
from autoprec.graph import sensitivity
from autoprec.models import load_model


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: ["resnet18", "resnet50"])
    image_size: int = 32
    write_docs: bool = False


def parse() -> Args:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=Args().models)
    p.add_argument("--write-docs", action="store_true")
    ns = p.parse_args()
    return Args(models=ns.models, write_docs=ns.write_docs)


def main() -> None:
    args = parse()
    lines = [
        "| model | layers | sweep s | taylor s | Spearman tf32 | bf16 | fp16 | fp8 | all |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in args.models:
        spec = load_model(name, num_classes=10, image_size=args.image_size)
        data = load_dataset_for(spec, "digits", seed=0)
        sweep = sensitivity(spec, data, method="sweep", cache=False)
        taylor = sensitivity(spec, data, method="taylor", cache=False)
        a = np.array(sweep.matrix())
        b = np.array(taylor.matrix())
        rhos = [spearmanr(a[:, j], b[:, j]).statistic for j in range(1, a.shape[1])]
        overall = spearmanr(a[:, 1:].ravel(), b[:, 1:].ravel()).statistic
        cells = " | ".join(f"{r:.2f}" for r in rhos)
        lines.append(
            f"| {name} | {len(sweep.layers)} | {sweep.wall_time_s:.1f} | {taylor.wall_time_s:.1f} "
            f"| {cells} | {overall:.2f} |"
        )
        print(lines[-1], flush=True)
    header = provenance("python experiments/bench_sensitivity.py --write-docs") + (
        f"Settings: `autoprec analyze` defaults: digits at {args.image_size}x{args.image_size}, "
        "4 fixed batches of 8 (one concatenated pass), precisions fp32/tf32/bf16/fp16/fp8, 30 "
        "fp32 warm-up steps, disk cache off. Times include the warm-up and torch.compile's "
        "first calls of the rounding kernels. Spearman: rank correlation over layers of the "
        "Taylor estimate of 1 - gradient cosine against the sweep's measured value, per "
        "precision and over all (layer, precision) pairs."
    )
    table = "\n".join(lines)
    publish("bench_sensitivity", f"## Sensitivity analysis\n\n{header}\n\n{table}\n", args)


if __name__ == "__main__":
    main()
