"""Wall time and quality of the per-layer sensitivity methods, and of `autoprec analyze`.

At `autoprec analyze`'s default settings (4 fixed batches of 8, fp32 + 4 lower precisions, 30
fp32 warm-up steps, images at 32x32), with the disk cache off, for each model:

- ``taylor`` (one pass) and ``auto`` at the default time budget (the sweep if it fits, else the
  focused sweep, else the estimate; autoprec.sensitivities.budget), and, for the models whose full
  sweep is affordable (``--sweep-models``), the full ``sweep`` and the ``focused`` sweep at a
  budget too small for the sweep (``--focused-budget``), their quality the Spearman rank
  correlation of 1 - gradient cosine against the full sweep's, over layers per precision and
  over all (layer, precision) pairs, on digits;
- the end-to-end wall time of ``autoprec analyze --model M`` (a fresh process and cache, the
  default dataset) for ``--analyze-models``. Target (issue 19): under 60 s for resnet50 and a
  ViT-tiny (timm, patch 4, 32x32) on this 2-core CPU.

The ViT-tiny is a user model, ``bench_sensitivity:vit_tiny`` (this file is its module).

    python experiments/bench_sensitivity.py --write-docs
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from benchlib import parse_args, provenance, publish
from scipy.stats import spearmanr

from autoprec.data import load_dataset_for
from autoprec.models import load_model
from autoprec.sensitivities import DEFAULT_TIME_BUDGET_S, sensitivity

HERE = Path(__file__).resolve().parent
VIT = "bench_sensitivity:vit_tiny"


def vit_tiny(num_classes: int = 10, image_size: int = 32):
    """timm's ViT-tiny (dim 192, depth 12, 3 heads) on patches of 4: 50 tunable layers."""
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", img_size=image_size, patch_size=4, num_classes=num_classes
    )


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: ["resnet18", "resnet50", VIT])
    sweep_models: list[str] = field(default_factory=lambda: ["resnet18"])
    # small enough that resnet18's sweep does not fit, large enough that its warm-up is not cut
    # (so that the quality column measures the interpolation alone)
    focused_budget: float = 30.0
    analyze_models: list[str] = field(default_factory=lambda: ["resnet50", VIT])
    image_size: int = 32
    write_docs: bool = False


def short(name: str) -> str:
    return "vit_tiny (timm, patch 4)" if name == VIT else name


def quality(table, sweep) -> str:
    """Spearman per precision and over all pairs against the sweep, as table cells."""
    if sweep is None:
        return " | ".join(["-"] * 5)
    a, b = np.array(sweep.matrix())[:, 1:], np.array(table.matrix())[:, 1:]
    rhos = [spearmanr(a[:, j], b[:, j]).statistic for j in range(a.shape[1])]
    rhos.append(spearmanr(a.ravel(), b.ravel()).statistic)
    return " | ".join(f"{r:.2f}" for r in rhos)


def method_rows(name: str, args: Args) -> list[str]:
    spec = load_model(name, num_classes=10, image_size=args.image_size)
    data = load_dataset_for(spec, "digits", seed=0)
    runs = [("taylor", "taylor", None), ("auto", "auto", DEFAULT_TIME_BUDGET_S)]
    if name in args.sweep_models:
        runs = [("sweep", "sweep", None), *runs]
        runs.append((f"focused ({args.focused_budget:g} s)", "focused", args.focused_budget))
    rows, sweep = [], None
    for label, method, budget in runs:
        kwargs = {} if budget is None else {"time_budget_s": budget}
        table = sensitivity(spec, data, method=method, cache=False, **kwargs)
        sweep = table if method == "sweep" else sweep
        swept = sum(map(table.is_measured, table.layers))
        rows.append(
            f"| {short(name)} | {len(table.layers)} | {label} | {table.method} | {swept} "
            f"| {table.wall_time_s:.1f} | {quality(table, sweep)} |"
        )
        print(rows[-1], flush=True)
    return rows


def analyze_row(name: str) -> str:
    """``autoprec analyze --model name`` in a fresh process with an empty cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, AUTOPREC_CACHE_DIR=cache)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "autoprec", "analyze", "--model", name],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        wall = time.perf_counter() - start
    summary = re.search(
        r"sensitivity: (\w+)( \((\d+) of \d+ layers swept)?.* on \w+, ([\d.]+) s", done.stdout
    )
    plan = re.search(r"sensitivity on \w+: ((?:sweep|focused|Taylor)[^(]*)", done.stderr)
    cut = re.search(r"fp32 warm-up \((\d+ of \d+) steps", done.stderr)
    method, swept, seconds = (
        (summary.group(1), summary.group(3), summary.group(4)) if summary else ("?", None, "?")
    )
    chosen = f"{method}: {swept} layers swept" if swept else method
    chosen += f" (planned: {plan.group(1).strip()})" if plan else ""
    chosen += f"; warm-up {cut.group(1)} steps" if cut else ""
    row = f"| {short(name)} | {wall:.1f} | {seconds} | {chosen} |"
    print(row, flush=True)
    return row


def main() -> None:
    args = parse_args(Args, __doc__.splitlines()[0])
    methods = [
        "| model | layers | asked | ran | layers swept | wall s | Spearman tf32 | bf16 | fp16 "
        "| fp8 | all |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in args.models:
        methods += method_rows(name, args)
    analyze = [
        "| model | `autoprec analyze` wall s | of which sensitivity s | method chosen |",
        "|---|---:|---:|---|",
    ]
    for name in args.analyze_models:
        analyze.append(analyze_row(name))
    header = provenance("python experiments/bench_sensitivity.py --write-docs") + (
        f"Settings: `autoprec analyze` defaults: 4 fixed batches of 8 (one concatenated pass), "
        f"precisions fp32/tf32/bf16/fp16/fp8, 30 fp32 warm-up steps (backed off as the warm-up "
        f"does), images at {args.image_size}x{args.image_size}, disk cache off; the methods "
        f"on digits, `auto` at the default {DEFAULT_TIME_BUDGET_S:.0f} s budget (warm-up "
        "included). Times include the warm-up and torch.compile's first calls of the "
        "rounding kernels. Spearman: rank correlation of 1 - gradient cosine against the full "
        "sweep's, over layers per precision and over all (layer, precision) pairs (- where the "
        "full sweep was not run). `analyze`: a fresh process and cache, the default dataset "
        "(teacher), everything from the start of the process to its end. With a budget the "
        "warm-up is cut to fewer steps when its back-off's worst case (4 attempts) would take "
        "more than 40% of the budget (said in the last column)."
    )
    body = "\n".join(methods) + "\n\n" + "\n".join(analyze)
    publish("bench_sensitivity", f"## Sensitivity analysis\n\n{header}\n\n{body}\n", args)


if __name__ == "__main__":
    main()
