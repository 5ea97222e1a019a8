"""The measured search on this machine's device, end to end, against AMP and the hand rules.

For each workload, `autoprec.search` with this machine's device as the target (`pricing
measured`, the program `--execution`): the per-layer table timed once (kept on disk per device
and software), the search ranked by it, the finalists timed as whole steps, the export. Then,
in one run side by side (`autoprec.timing.time_steps`: `--rounds` rounds, one step of each
program per round in a shuffled order), the export, the target's blanket AMP and every hand
rule that applies (`autoprec/agents/hand_rules.py`), each as production runs it: median step
time, throughput (tokens/s for the language models, samples/s otherwise) and the spread (the
interquartile range over the median). The verdict per workload: the export is at least as fast
as the fastest of them within the run's noise (its median at most the fastest's times one plus
the larger of the two spreads), and strictly faster when beyond it.

Workloads (`--preset`):
- `cpu` (this machine, no GPU): resnet18 on `teacher`, trained at 32x32, batch 32, eager (the CPU's
  default program: inductor's compile of each program costs more than the search can win);
  the CPU runs fp32 and bf16 (autocast).
- `gpu` (the issue's, for a lent GPU; at most 8 minutes, `--max-minutes` stops starting new
  workloads after 7): the zoo's llama (`llama-small` fine-tuned on `python-text`) at
  `llama3-8b` widths and at the 1B-class `llama3.2-1b` widths (batch 1 sequence of 8192,
  compiled, bf16 and tensorwise fp8; from the 4-bit study's fp32 checkpoint with its AdamW
  recipe), and resnet50 at batch 256 on 224x224, channels_last, eager (a compile per finalist
  would not fit the budget), fp32/tf32/bf16. Compiling is what the budget buys: each unique
  Linear in each precision, then each finalist's whole step, so a workload that would start
  after `--max-minutes` is skipped, in this order.

    python experiments/measured_search.py --preset cpu --write-docs
    python experiments/measured_search.py --preset gpu --write-docs --docs $OUT/benchmarks.md
    python experiments/measured_search.py --preset cpu --quick    # a smoke run (the test)
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import invocation, md_table, parse_args, provenance, publish

from autoprec.agents.naming import file_safe
from autoprec.evaluate.workload import Workload as Load
from autoprec.evaluate.workload import production_spec, training_spec
from autoprec.hardware import detect
from autoprec.hardware.defaults import amp_policy
from autoprec.pipeline import SearchCallbacks, SearchConfig, run_search
from autoprec.policy.io import load_policy
from autoprec.timing import time_steps

SECTION = "measured_search"
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Args:
    preset: str = field(default="cpu", metadata={"help": "cpu or gpu (the workloads)"})
    budget: int = 8
    rounds: int = 15
    agent: str = "tpe"
    table_check: int = field(
        default=-1,
        metadata={"help": "random policies whose whole steps check the per-layer table's "
                  "estimates (-1: 6 on the cpu preset, 0 on the gpu one)"},
    )  # fmt: skip
    max_minutes: float = 7.0
    quick: bool = False
    write_docs: bool = False
    docs: str | None = None
    json: str | None = None


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    dataset: str
    precisions: str
    execution: str
    batch: int | None = None
    train_shape: str | None = None
    train_image_size: int | None = None
    image_size: int | None = None
    tokens: int = 1  # tokens per sample (throughput in tokens/s for the language models)
    extra: dict[str, Any] = field(default_factory=dict)


def workloads(args: Args) -> list[Workload]:
    if args.preset == "cpu":
        if args.quick:
            return [Workload("tinycnn, digits, 8x8, batch 32", "tinycnn", "digits",
                             "fp32,bf16", "eager", batch=32)]  # fmt: skip
        return [Workload("resnet18, teacher, 32x32, batch 32", "resnet18", "teacher",
                         "fp32,bf16", "eager", batch=32, train_image_size=32)]  # fmt: skip
    # the 4-bit study's language model and recipe (README): its fp32 checkpoint, AdamW at 3e-4
    lm = {"init_weights": str(RESULTS / "lm" / "llama-small-python-text-fp32.pt"),
          "max_samples": 4096, "recipe": {"optimizer": "adamw", "lr": 3e-4}}  # fmt: skip
    return [
        Workload("llama at llama3-8b widths, batch 1 x 8192", "llama-small", "python-text",
                 "bf16,fp8", "compiled", train_shape="llama3-8b", tokens=8192, extra=lm),
        Workload("llama at llama3.2-1b widths, batch 1 x 8192", "llama-small", "python-text",
                 "bf16,fp8", "compiled", train_shape="llama3.2-1b", tokens=8192, extra=lm),
        Workload("resnet50, teacher, 224x224, batch 256, channels_last", "resnet50",
                 "teacher", "fp32,tf32,bf16", "eager", batch=256, train_image_size=224),
    ]  # fmt: skip


class Said(SearchCallbacks):
    """The search's lines, printed and kept."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)
        print(f"  {text}", flush=True)


def spread(seconds: tuple[float, ...]) -> float:
    """The interquartile range over the median."""
    if len(seconds) < 4:
        return float("nan")
    q = statistics.quantiles(seconds, n=4)
    return (q[2] - q[0]) / statistics.median(seconds)


def search_config(w: Workload, args: Args, folder: Path) -> SearchConfig:
    """The search of workload ``w``: this machine's device as the target, measured."""
    return SearchConfig(
        model=w.model, dataset=w.dataset, target=detect().name, pricing="measured",
        execution=w.execution, precisions=w.precisions, train_shape=w.train_shape,
        train_batch_size=w.batch, train_image_size=w.train_image_size,
        image_size=w.image_size, agent=args.agent, budget=args.budget, mlflow=False,
        out=str(folder / "export.yaml"), pareto_dir=str(folder), steps=2 if args.quick else None,
        storage=f"sqlite:///{folder / 'optuna.db'}",
        max_samples=w.extra.get("max_samples"), init_weights=w.extra.get("init_weights"),
        recipe=w.extra.get("recipe", {}),
    )  # fmt: skip


def run_workload(w: Workload, args: Args, folder: Path) -> dict[str, Any]:
    device = detect()
    config = search_config(w, args, folder)
    said = Said()
    begin = time.perf_counter()
    report = run_search(config, said)
    searched_s = time.perf_counter() - begin
    export = load_policy(report.policy_path)
    arms = [("export", export), ("AMP", amp_policy(device))]
    rules_folder = report.written.get("rules")
    for name, _, _ in report.rules:
        path = Path(rules_folder) / f"{file_safe(name)}.yaml" if rules_folder else None
        if path is not None and path.exists():
            arms.append((name, load_policy(path)))
    load = Load(w.model, w.dataset, train_shape=w.train_shape,
                train_image_size=w.train_image_size).resolved()  # fmt: skip
    spec = production_spec(training_spec(load), load.model, load.num_classes, load.train_shape,
                           load.train_image_size)  # fmt: skip
    batch = report.config.train_batch_size
    timings = time_steps(
        spec, [p for _, p in arms], batch_size=batch, device=_torch_device(),
        execution=w.execution, steps=3 if args.quick else args.rounds,
        warmup=1 if args.quick else 3,
    )  # fmt: skip
    rows = []
    amp_loss = None if report.amp is None else report.amp.metrics.loss_delta
    for (name, policy), t in zip(arms, timings, strict=True):
        metrics = dict(policy.metrics or {})
        if name == "AMP":
            metrics["loss_delta"] = amp_loss
        rows.append({
            "arm": name,
            "step_s": t.step_s,
            "throughput": batch * w.tokens / t.step_s if t.ok else float("nan"),
            "spread": spread(t.seconds),
            "loss_delta": metrics.get("loss_delta"),
            "execution": t.execution,
            "error": t.error,
            "layers": _mix(policy, export),
            "program": _program(policy, spec),
        })  # fmt: skip
    layers = layer_ratios(w, report.config)
    checks = args.table_check if args.table_check >= 0 else (6 if args.preset == "cpu" else 0)
    table = table_check(w, report.config, checks) if checks else None
    return {
        "workload": w.name, "device": device.name, "batch": batch, "tokens": w.tokens,
        "search_s": searched_s, "rows": rows, "verdict": verdict(rows), "table": table,
        "layers": layers,
        "provenance": {k: v for k, v in export.provenance.items() if k.startswith("measured_")},
        "phases": dict(report.phase_times),
    }  # fmt: skip


def layer_ratios(w: Workload, config: SearchConfig) -> dict[str, list[float]]:
    """From the per-layer table the search measured: per precision, each unique layer's time
    alone over its fp32 time (sorted)."""
    from autoprec.precision import parse_precision
    from autoprec.timing import LayerTimings

    load = Load(w.model, config.dataset, train_shape=w.train_shape,
                train_image_size=w.train_image_size).resolved()  # fmt: skip
    spec = production_spec(training_spec(load), load.model, load.num_classes, load.train_shape,
                           load.train_image_size)  # fmt: skip
    from autoprec.timing.step import memory_format_for

    table = LayerTimings(spec, config.train_batch_size, detect().name, _torch_device(),
                         w.execution, memory_format_for(spec))  # fmt: skip
    out: dict[str, list[float]] = {}
    for p in (parse_precision(x) for x in config.precisions.split(",")):
        if p.value == "fp32":
            continue
        ratios = [table.alone(s.names[0], p) / table.alone(s.names[0], "fp32") for s in table.sites]
        out[p.value] = sorted(r for r in ratios if r == r)
    return out


def table_check(w: Workload, config: SearchConfig, n: int) -> dict[str, Any]:
    """How well the per-layer table ranks whole steps: ``n`` random policies (each layer one
    of its runnable precisions, seeded) plus fp32 and AMP, estimated from the search's table
    and timed whole, side by side; the rank correlation (Spearman) and the median ratio."""
    import random

    from autoprec.agents import Problem
    from autoprec.evaluate import EvaluatorConfig
    from autoprec.evaluate.workload import build_evaluator
    from autoprec.hardware.fit import rank_correlation

    load = Load(w.model, config.dataset, train_shape=w.train_shape,
                train_image_size=w.train_image_size, cost_batch_size=config.train_batch_size,
                max_samples=config.max_samples).resolved()  # fmt: skip
    settings = EvaluatorConfig(pricing="measured", execution=w.execution)
    evaluator, _ = build_evaluator(load, detect(), settings)
    problem = Problem(evaluator, precisions=tuple(config.precisions.split(",")))
    rng = random.Random(0)
    policies = [{n: "fp32" for n in problem.layers()},
                {n: problem.choices(n)[-1] for n in problem.layers()}]  # fmt: skip
    policies += [{n: rng.choice(problem.choices(n)) for n in problem.layers()} for _ in range(n)]
    resolved = [problem.to_policy(p).resolve(evaluator.spec.module) for p in policies]
    estimated = [evaluator.costs.estimate(p)[0] for p in resolved]
    timings = evaluator.time_steps([problem.to_policy(p) for p in policies])
    pairs = [(e, t.step_s) for e, t in zip(estimated, timings, strict=True) if t.ok]
    rho = rank_correlation([e for e, _ in pairs], [m for _, m in pairs])
    ratio = statistics.median(m / e for e, m in pairs) if pairs else float("nan")
    return {"policies": len(pairs), "spearman": rho, "median_measured_over_table": ratio}


def _torch_device() -> str:
    from autoprec.evaluate.measured import local_torch_device

    return str(local_torch_device())


def _mix(policy: Any, export: Any) -> str:
    """``{precision: layers}`` of a policy, e.g. ``bf16 x 20, fp32 x 1``."""
    from collections import Counter

    layers = dict(policy.layers)
    counts = Counter(str(getattr(v, "value", v)) for v in layers.values())
    default = str(getattr(policy.default, "value", policy.default))
    shown = ", ".join(f"{p} x {n}" for p, n in counts.most_common())
    return f"default {default}" + (f"; {shown}" if shown else "")


def _program(policy: Any, spec: Any) -> str:
    """Each layer's precision and the loss scaling: two policies with one program run alike."""
    precisions = {n: p.value for n, p in policy.resolve(spec.module).items()}
    scaling = policy.loss_scaling
    return json.dumps([precisions, None if scaling is None else str(scaling)], sort_keys=True)


def verdict(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if r["error"] is None]
    export = next((r for r in ok if r["arm"] == "export"), None)
    others = [r for r in ok if r["arm"] != "export"]
    if export is None or not others:
        return "not compared (a row failed)"
    same = [r["arm"] for r in others if r["program"] == export["program"]]
    if same:  # one program timed twice: their difference is this run's noise
        twin = next(r for r in others if r["arm"] == same[0])
        return (
            f"the same program as {same[0]} (every layer's precision), timed twice in this run: "
            f"{export['step_s'] * 1e3:.1f} against {twin['step_s'] * 1e3:.1f} ms, the run's noise"
        )
    best = min(others, key=lambda r: r["step_s"])
    spreads = [x for x in (export["spread"], best["spread"]) if x == x]  # not NaN
    noise = max(spreads, default=0.0) / 2  # half the interquartile range
    ratio = best["step_s"] / export["step_s"]
    if export["step_s"] < best["step_s"] * (1 - noise):
        return f"strictly faster than the fastest other arm, {best['arm']} ({ratio:.2f}x)"
    if export["step_s"] <= best["step_s"] * (1 + noise):
        return f"as fast as the fastest other arm, {best['arm']}, within noise ({ratio:.2f}x)"
    return f"slower than {best['arm']} ({ratio:.2f}x, beyond the noise of +-{noise:.0%})"


def report_text(results: list[dict[str, Any]], args: Args) -> str:
    parts = ["## The measured search on this machine's device\n", provenance(invocation(__file__))]
    parts.append(
        "\nEach workload: `autoprec.search` with this machine's device as the target (pricing "
        f"measured; agent {args.agent}, budget {args.budget}); then the export, the target's AMP "
        "and every hand rule that applies, timed side by side as whole training steps of the "
        f"program production runs ({args.rounds} rounds of one step each, shuffled). Spread: "
        "interquartile range over the median. Loss delta: the search's fine-tune of each.\n"
    )
    for r in results:
        unit = "tokens/s" if r["tokens"] > 1 else "samples/s"
        parts.append(f"\n### {r['workload']} on {r['device']}\n")
        rows = [
            [x["arm"], x["execution"], _f(x["step_s"] * 1e3, ".2f"), _f(x["throughput"], ",.0f"),
             _f(x["spread"] * 100, ".0f") + "%", _f(x["loss_delta"], "+.4f"), x["layers"],
             x["error"] or ""]
            for x in r["rows"]
        ]  # fmt: skip
        parts.append(md_table(
            ["arm", "program", "step ms", unit, "spread", "loss delta", "layers", "error"], rows
        ))  # fmt: skip
        prov = ", ".join(f"{k.removeprefix('measured_')} {v}" for k, v in r["provenance"].items())
        parts.append(f"\nVerdict: the export is {r['verdict']}. Search {r['search_s']:.0f} s; "
                     f"the export's provenance: {prov}.\n")  # fmt: skip
        for p, ratios in (r.get("layers") or {}).items():
            if ratios:
                faster = sum(x < 1 for x in ratios)
                parts.append(
                    f"\nThe per-layer table: {p} faster than fp32 alone on {faster} of "
                    f"{len(ratios)} unique layers; its time over fp32's {ratios[0]:.2f}x to "
                    f"{ratios[-1]:.2f}x (median {statistics.median(ratios):.2f}x).\n"
                )
        if r.get("table"):
            t = r["table"]
            parts.append(
                f"\nThe per-layer table against whole steps ({t['policies']} policies: fp32, the "
                "fastest-format one and random ones, timed side by side): Spearman "
                f"{_f(t['spearman'], '.2f')}, measured over estimated step "
                f"{_f(t['median_measured_over_table'], '.2f')}x (median).\n"
            )
    return "".join(parts)


def _f(value: Any, fmt: str) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return format(value, fmt)


def forwarded(args: Any) -> list[str]:
    """This script's command line from gpu_validate's ``args`` (its ``--only measured``): the
    gpu workloads on the GPU, the quick cpu one in a dry run."""
    if args.only != ["measured"]:
        raise SystemExit("--only measured runs alone (experiments/measured_search.py)")
    argv = ["--preset", "cpu" if args.dry_run else "gpu", "--max-minutes", str(args.max_minutes)]
    argv += ["--quick"] if args.dry_run else []
    argv += ["--write-docs", "--docs", str(args.docs)] if args.write_docs else []
    return argv + (["--json", str(args.json)] if args.json is not None else [])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, w in enumerate(workloads(args)):
            if (time.perf_counter() - start) / 60 > args.max_minutes:
                print(f"skipping {w.name}: past --max-minutes {args.max_minutes}")
                continue
            print(f"== {w.name}", flush=True)
            results.append(run_workload(w, args, Path(tmp) / str(i)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    publish(SECTION, report_text(results, args), args, path=args.docs and Path(args.docs))
    return results


if __name__ == "__main__":
    main()
