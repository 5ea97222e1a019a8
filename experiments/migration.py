"""Automatic migration: `autoprec migrate` on every built-in and several torchvision models.

For each model the script runs `autoprec migrate --model M --target T` as a user would (one
process per model, in a scratch folder, the evaluator cache at `--cache-dir`) and reads the plan
it writes (`--plan`): whether the whole model migrated to the target's low precision within the
accuracy tolerance without intervention (the first, whole-model step was kept), the share of
tunable layers that ended low, the final policy's loss and accuracy delta against fp32, its
speedup, the number of steps and the wall time. Image models fine-tune on `--dataset` (the
default dataset unless given; torchvision ones at 32x32, the command's default); text models on
`tokens`. A run on another dataset than the default writes its own section
(`migration_<dataset>`).

Reported: the share of models migrated without intervention, and the median loss delta and
accuracy delta of the final policies.

    python experiments/migration.py --write-docs     # the full run (see experiments/README.md)
    python experiments/migration.py --quick          # mlp and tinycnn, 5 steps, for the test
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from benchlib import DOCS, dataset_suffix, invocation, md_table, parse_args, provenance, publish

from autoprec.cache import cache_dir as default_cache_dir
from autoprec.defaults import DEFAULT_DATASET
from autoprec.models import list_models

TORCHVISION = [
    "resnet18",
    "resnet50",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "densenet121",
    "regnet_y_400mf",
]
TEXT_TASKS = ("sequence-classification", "token-classification")


def builtin_models() -> list[str]:
    """The built-in family of `autoprec models` (no extra needed)."""
    return [m["name"] for m in list_models() if m["family"] == "builtin"]


@dataclass
class Args:
    models: list[str] = field(
        default_factory=lambda: [*builtin_models(), *TORCHVISION],
        metadata={"help": "default: every built-in model and seven torchvision models"},
    )
    target: str = "h100-sxm"
    dataset: str = field(
        default=DEFAULT_DATASET, metadata={"help": "image models' dataset (text: tokens)"}
    )
    precision: str | None = field(default=None, metadata={"help": "default: the target's"})
    accuracy_tolerance: float | None = field(
        default=None, metadata={"help": "default: the command's"}
    )
    steps: int | None = field(default=None, metadata={"help": "fine-tune steps per evaluation"})
    cache_dir: Path | None = field(
        default=None, metadata={"help": "evaluation cache (default: autoprec's cache folder)"}
    )
    timeout_s: float = field(default=3600.0, metadata={"help": "per model"})
    quick: bool = field(default=False, metadata={"help": "mlp and tinycnn, 5 steps (the test)"})
    write_docs: bool = False
    docs: Path = field(default=DOCS, metadata={"help": "the markdown file to write"})


def dataset_for(model: str, image_dataset: str = DEFAULT_DATASET) -> str:
    tasks = {m["name"]: m["task"] for m in list_models()}
    return "tokens" if tasks.get(model) in TEXT_TASKS else image_dataset


def migrate_command(args: Args, model: str, work: Path) -> list[str]:
    cmd = [
        str(Path(sys.executable).with_name("autoprec")),
        "migrate",
        "--model",
        model,
        "--target",
        args.target,
        "--out",
        str(work / f"{model}.yaml"),
        "--plan",
        str(work / f"{model}-plan.yaml"),
    ]
    dataset = dataset_for(model, args.dataset)
    if dataset != DEFAULT_DATASET:
        cmd += ["--dataset", dataset]
    for flag, value in (
        ("--precision", args.precision),
        ("--accuracy-tolerance", args.accuracy_tolerance),
        ("--steps", args.steps),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def run_one(args: Args, model: str, work: Path, cache: Path) -> dict[str, Any]:
    """Migrate one model; the plan's numbers, or why it failed."""
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            migrate_command(args, model, work),
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"model": model, "error": f"timed out after {args.timeout_s:.0f} s"}
    wall = time.perf_counter() - start
    (work / f"{model}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": model, "error": f"exit {proc.returncode}: {last[:120]}", "wall_s": wall}
    plan = yaml.safe_load((work / f"{model}-plan.yaml").read_text())
    metrics = plan["metrics"]
    return {
        "model": model,
        "dataset": dataset_for(model, args.dataset),
        "precision": plan["precision"],
        "tolerance": plan["accuracy_tolerance"],
        "layers": plan["total_layers"],
        "without_intervention": bool(plan["migrated_without_intervention"]),
        "lowered_share": float(plan["lowered_share"]),
        "steps": len(plan["steps"]),
        "loss_delta": float(metrics["loss_delta"]),
        "accuracy_delta": float(metrics["accuracy_delta"]),
        "speedup": float(metrics["speedup"]),
        "wall_s": wall,
    }


def row(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [r["model"], "-", "-", "-", f"failed: {r['error']}"] + ["-"] * 6
    return [
        r["model"],
        r["dataset"],
        str(r["layers"]),
        r["precision"],
        "yes" if r["without_intervention"] else "no",
        f"{r['lowered_share']:.0%}",
        str(r["steps"]),
        f"{r['loss_delta']:+.4f}",
        f"{100 * r['accuracy_delta']:+.2f}",
        f"{r['speedup']:.2f}",
        f"{r['wall_s']:.0f}",
    ]


def summary(results: list[dict[str, Any]]) -> str:
    done = [r for r in results if "error" not in r]
    failed = len(results) - len(done)
    if not done:
        return "No migration finished."
    ok = sum(r["without_intervention"] for r in done)
    loss = statistics.median(r["loss_delta"] for r in done)
    acc = statistics.median(r["accuracy_delta"] for r in done)
    return (
        f"**{ok} of {len(done)}** models ({ok / len(done):.0%}) migrated within the tolerance "
        f"without intervention; median loss delta of the final policies {loss:+.4f}, median "
        f"accuracy delta {100 * acc:+.2f} pp"
        + (f"; {failed} failed (see the rows)." if failed else ".")
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.quick:
        args.models = ["mlp", "tinycnn"]
        args.steps = args.steps or 5
    cache = args.cache_dir or default_cache_dir()
    work = Path(tempfile.mkdtemp(prefix="autoprec-migration-"))
    print(f"cache: {cache}; plans and logs: {work}", flush=True)
    results = []
    begin = time.perf_counter()
    for model in args.models:
        r = run_one(args, model, work, cache)
        results.append(r)
        print(" | ".join(row(r)), flush=True)
    total = time.perf_counter() - begin
    tolerance = next((r["tolerance"] for r in results if "tolerance" in r), math.nan)
    body = "\n".join(
        [
            f"## Migration: `autoprec migrate` without intervention ({args.dataset})",
            "",
            provenance(invocation(__file__)),
            f"`autoprec migrate --model M --target {args.target}` per model with the command's "
            f"defaults (accuracy tolerance: loss delta <= {tolerance:g}"
            + (f", {args.steps} fine-tune steps per evaluation" if args.steps else "")
            + f"): image models on {args.dataset} (torchvision ones at 32x32), text models "
            "on `tokens`; the evaluator cache was shared. Without intervention: the first step, "
            "the whole model at the target's low precision, was kept. Lowered: share of "
            "tunable layers low in the final policy. Loss and accuracy deltas against fp32 and "
            "the speedup (cost model, batch 256) are the final policy's, from the plan file. "
            f"Total wall time {total:.0f} s.",
            "",
            md_table(
                [
                    "model",
                    "data",
                    "layers",
                    "precision",
                    "without intervention",
                    "lowered",
                    "steps",
                    "loss delta",
                    "accuracy delta (pp)",
                    "speedup",
                    "wall s",
                ],
                [row(r) for r in results],
            ),
            "",
            summary(results),
            "",
        ]
    )
    publish("migration" + dataset_suffix(args.dataset), body, args)
    return results


if __name__ == "__main__":
    main()
