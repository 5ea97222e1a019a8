"""The cost model against training steps measured on an H200, before and after calibration.

The measured rows are those of the first GPU runs (`gpu_validate.py` on an H200,
experiments/results/gpu_validate-h200.json and gpu_validate-h200-rerun.json, docs/benchmarks.md
sections `gpu_validate` and `gpu_validate_rerun`): the zoo's llama at llama3-8b widths (4
blocks, one 8192-token sequence) under AMP, the three hand-written fp8 rules and the searched
export, eager and under `torch.compile`, and resnet50 at batch 256 (224x224, NCHW, eager)
under fp32, tf32, AMP-bf16, the searched policy and three random policies; SGD with momentum.
A row measured in both runs keeps both medians (the median of the two is its time).

1. `--extract` (once; its output is committed): the policies of those rows, which the JSON
   files name but do not list, rebuilt as gpu_validate.py built them (AMP and the uniform ones,
   the hand rules of autoprec/agents/hand_rules.py at the measured shape, the kept llama
   export, the random policies of seed 0; resnet50's searched policy, "bf16 53 tf32 1", is
   the one single-tf32 layer whose prediction equals the recorded one), each checked against
   the row's recorded layer mix, written as a measurement file
   (experiments/results/gpu_validate-h200-steps.json, `autoprec.hardware.measurements`' format).
2. The fit, `autoprec.hardware.fit.calibrate_from_steps` (the call behind `autoprec hardware
   calibrate --from`): `split_rows` holds rows out (per model and execution mode, in order of
   measured time, every second row from the second fastest), `fit_efficiency` fits h200's
   factors to the other rows, and the fitted calibration is written
   (experiments/results/calibration-h200.json; the command writes it into the cache, where the
   cost model loads it).
3. The report: per held-out row the prediction of the cost model as it was (no execution
   mode, published factors), with the row's execution mode, and with the mode and the fitted
   factors; the median absolute relative error of each (target: at most 15% after); the rank
   correlation (Spearman) of predicted and measured step times over llama's ten rows, eager
   and compiled together (target: at least 0.9), and over the held-out rows.

    python experiments/calibrate_cost_model.py --extract      # rebuild the measurement file
    python experiments/calibrate_cost_model.py --write-docs   # fit, report, docs/cost-model.md
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import invocation, md_table, parse_args, provenance, publish

from autoprec.hardware import CostModel, get_device
from autoprec.hardware.efficiency import published_efficiency
from autoprec.hardware.fit import calibrate_from_steps, predict, rank_correlation, relative_errors
from autoprec.hardware.measurements import MeasuredStep, read_measurements, write_measurements

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs" / "cost-model.md"
SECTION = "calibrate_cost_model"
TARGET_ERROR, TARGET_RHO = 0.15, 0.9


@dataclass
class Args:
    runs: list[Path] = field(
        default_factory=lambda: [
            RESULTS / "gpu_validate-h200.json",
            RESULTS / "gpu_validate-h200-rerun.json",
        ],
        metadata={"help": "gpu_validate.py JSON results (--extract reads them)"},
    )
    steps: Path = field(
        default=RESULTS / "gpu_validate-h200-steps.json",
        metadata={"help": "the measurement file (--extract writes it; the fit reads it)"},
    )
    calibration: Path = field(
        default=RESULTS / "calibration-h200.json", metadata={"help": "the fitted calibration"}
    )
    extract: bool = field(default=False, metadata={"help": "rebuild --steps from --runs"})
    write_docs: bool = False
    docs: Path = DOCS


# ------------------------------------------------------------------------------ 1. extraction
def _builds() -> dict[str, tuple[str, dict[str, Any], int, Any]]:
    """The measured models as gpu_validate.py built them: JSON name -> (zoo name, load_model
    arguments, batch, gpu_validate's Bench)."""
    import gpu_validate  # a sibling script, importable as benchlib is

    args = gpu_validate.Args()
    benches = {b.name: b for b in gpu_validate.benches(args)}
    llama = f"llama at {args.llama_shape}"
    return {
        llama: ("llama", {"shape": args.llama_shape}, args.llama_batch, benches[llama]),
        args.model: (
            args.model,
            {"num_classes": 1000, "image_size": args.image_size},
            args.batch_size,
            benches[args.model],
        ),
    }


def _policies(bench: Any, table: Any, cost_spec: Any, device: Any) -> dict[str, Any]:
    """Every policy gpu_validate.py measured on ``bench``, by row name (compiled rows: the
    eager row's policy)."""
    import gpu_validate

    from autoprec.hardware.defaults import amp_policy
    from autoprec.policy import PrecisionPolicy
    from autoprec.policy.io import load_policy

    named = {
        "fp32 (TF32 off)": PrecisionPolicy.uniform("fp32"),
        "tf32": amp_policy(device, "tf32"),
        "AMP-bf16": amp_policy(device, "bf16"),
    }
    if bench.llm:
        named.update(gpu_validate.hand_rules(bench, device, cost_spec))
        named["searched"] = gpu_validate.scaled(load_policy(bench.policy_file))
    else:
        randoms = gpu_validate.random_policies(table, device, 4, 0)
        named.update({f"random {i + 1}": p for i, p in enumerate(randoms)})
    return named


def _searched_single_tf32(table: Any, device: Any, batch: int, predicted: float) -> Any:
    """resnet50's searched policy, recorded only as "bf16 53 tf32 1" and its prediction: the
    AMP policy with the one layer in tf32 whose prediction (the cost model of the run, which
    priced the default program as today's does) equals the recorded one."""
    from autoprec.policy import PrecisionPolicy

    model, names = CostModel(device, published_efficiency(device)), [r.name for r in table.rows]
    found = []
    for name in names:
        policy = PrecisionPolicy(layers={n: "tf32" if n == name else "bf16" for n in names})
        if abs(model.step(table, policy, batch_size=batch).step_time_s - predicted) < 1e-9:
            found.append(policy)
    return found[0] if len(found) == 1 else None


def extract(args: Args) -> tuple[str, list[MeasuredStep]]:
    """The measured rows of ``args.runs`` with their policies (see the module docstring)."""
    import torch

    from autoprec.graph import analyze

    devices = {json.loads(p.read_text())["predicted_for"] for p in args.runs}
    if len(devices) != 1:
        raise SystemExit(f"--runs predict for {', '.join(sorted(devices))}: one device at a time")
    device = get_device(devices.pop())
    import gpu_validate

    builds, rows, notes = _builds(), {}, []
    for path in args.runs:
        run = json.loads(path.read_text())
        for model in run["models"]:
            if model["model"] not in builds:
                continue
            name, build, batch, bench = builds[model["model"]]
            with torch.device("meta"):
                cost_spec = bench.build()
            table = analyze(cost_spec, batch, cache=True)
            named = _policies(bench, table, cost_spec, device)
            for raw in model["rows"]:
                if "step_s" not in raw:
                    continue
                base = raw["policy"].removesuffix(", compiled")
                policy = named.get(base)
                if policy is None and base == "searched":
                    policy = _searched_single_tf32(table, device, batch, raw["pred_step_s"])
                if policy is None or gpu_validate._layer_mix(policy, cost_spec) != raw["layers"]:
                    notes.append(f"{model['model']} / {raw['policy']}: policy not rebuilt")
                    continue
                key, source = (model["model"], raw["policy"]), f"{path.name}: {model['model']}"
                if key in rows:  # measured again in the other run
                    old = rows[key]
                    times, source = (*old.step_s, raw["step_s"]), f"{old.source}; {path.name}"
                    rows[key] = dataclasses.replace(old, step_s=times, source=source)
                    continue
                rows[key] = MeasuredStep(
                    label=f"{model['model']} / {raw['policy']}",
                    model=name,
                    build=build,
                    batch_size=batch,
                    policy=policy,
                    execution="compiled" if base != raw["policy"] else "eager",
                    step_s=(raw["step_s"],),
                    source=source,
                )
    for line in notes:
        print("left out:", line)
    return device.name, list(rows.values())


# ------------------------------------------------------------------------ 2. fit, 3. report
def table_for(row: MeasuredStep) -> Any:
    """The layer table of a measured row's model at its batch (on the meta device)."""
    import torch

    from autoprec.graph import analyze
    from autoprec.models import load_model

    with torch.device("meta"):
        spec = load_model(row.model, **row.build)
    return analyze(spec, row.batch_size, cache=True)


#: The predictions compared: the cost model as it was (no execution mode, the published
#: factors), with each row's execution mode, and with the mode and the fitted factors.
COLUMNS = ("as it was", "with the mode", "calibrated")


@dataclass
class Result:
    """What the report needs: the rows, the factors, and per column the predictions."""

    device: Any
    rows: list[MeasuredStep]
    fit: list[MeasuredStep]
    held: list[MeasuredStep]
    start: Any
    fitted: Any
    predicted: dict[str, dict[tuple[str, str], float]]  # column -> _key(row) -> seconds


def run(args: Args) -> Result:
    """The library's calibration (split, fit on the fit rows, the calibration written to
    ``args.calibration``), then every row predicted three ways."""
    _, rows = read_measurements(args.steps)
    tables = {row.table_key: table_for(row) for row in rows}
    fit = calibrate_from_steps(args.steps, lambda r: tables[r.table_key], output=args.calibration)
    device = get_device(fit.device)
    predicted: dict[str, dict[tuple[str, str], float]] = {}
    for column, efficiency in zip(COLUMNS, (fit.start, fit.start, fit.fitted), strict=True):
        model = CostModel(device, efficiency)
        if column == "as it was":  # the default program, no execution mode
            predicted[column] = {
                _key(r): model.step(
                    tables[r.table_key],
                    r.policy,
                    optimizer=r.optimizer,
                    batch_size=r.batch_size,
                    memory_format=r.memory_format,
                ).step_time_s
                for r in rows
            }
        else:
            predicted[column] = {_key(r): predict(model, r, tables[r.table_key]) for r in rows}
    return Result(
        device, rows, list(fit.fit_rows), list(fit.held_out), fit.start, fit.fitted, predicted
    )


def _key(row: MeasuredStep) -> tuple[str, str]:
    return row.label, row.execution


def errors(result: Result, rows: list[MeasuredStep], column: str) -> list[float]:
    preds = [result.predicted[column][_key(r)] for r in rows]
    return relative_errors(preds, [r.measured_s for r in rows])


def median_error(result: Result, rows: list[MeasuredStep], column: str) -> float:
    return statistics.median(abs(e) for e in errors(result, rows, column))


def rho(result: Result, rows: list[MeasuredStep], column: str) -> float | None:
    preds = [result.predicted[column][_key(r)] for r in rows]
    return rank_correlation(preds, [r.measured_s for r in rows])


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(HERE.parent))
    except ValueError:
        return str(path)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _factors(start: Any, fitted: Any) -> str:
    """The factors before and after, as a table (the matmul factors the fit left alone
    omitted)."""
    rows = [
        (f"matmul efficiency, {p}", start.compute[p], v)
        for p, v in fitted.compute.items()
        if v != start.compute[p]
    ]
    rows += [
        (f"convolution efficiency, {p}", start.conv(p), v) for p, v in fitted.conv_compute.items()
    ]
    rows += [
        ("bandwidth efficiency", start.bandwidth, fitted.bandwidth),
        ("kernel overhead (us)", start.kernel_overhead_s * 1e6, fitted.kernel_overhead_s * 1e6),
        ("compiled element-wise fraction", start.fused_elementwise, fitted.fused_elementwise),
    ]
    table = [[name, f"{before:.3f}", f"{after:.3f}"] for name, before, after in rows]
    return md_table(["factor", "before (published/default)", "fitted"], table)


def report(args: Args, result: Result) -> str:
    held, fit = result.held, result.fit
    llama = [r for r in result.rows if r.model == "llama"]
    table_rows = []
    for r in sorted(held, key=lambda r: r.label):
        cells = [r.label, r.execution, _ms(r.measured_s)]
        for column in COLUMNS:
            pred = result.predicted[column][_key(r)]
            cells += [_ms(pred), f"{pred / r.measured_s - 1:+.0%}"]
        table_rows.append(cells)
    header = ["held-out row", "mode", "measured ms"]
    for column in COLUMNS:
        header += [f"{column} ms", "error"]
    after = median_error(result, held, "calibrated")
    rho_after = rho(result, llama, "calibrated")
    summary = [
        [
            column,
            f"{median_error(result, held, column):.1%}",
            f"{median_error(result, fit, column):.1%}",
            _f(rho(result, llama, column), ".2f"),
            _f(rho(result, [r for r in held if r.model == "llama"], column), ".2f"),
            _f(rho(result, held, column), ".2f"),
        ]
        for column in COLUMNS
    ]
    verdict = (
        f"Targets: median absolute error on the held-out rows at most {TARGET_ERROR:.0%} after "
        f"calibration: **{after:.1%}**, {'met' if after <= TARGET_ERROR else 'missed'}; rank "
        f"correlation over llama's {len(llama)} rows, eager and compiled together, at least "
        f"{TARGET_RHO}: **{_f(rho_after, '.2f')}**, "
        + ("met" if rho_after is not None and rho_after >= TARGET_RHO else "missed")
        + f" (those rows include the {sum(r.model == 'llama' for r in fit)} llama rows the fit "
        "used; over the held-out llama rows alone, see the table)."
    )
    return "\n".join(
        [
            "## Calibration from measured H200 steps",
            "",
            provenance(invocation(__file__)),
            f"Data: `{_shown(args.steps)}` ({len(result.rows)} rows "
            "measured on an NVIDIA H200 by `experiments/gpu_validate.py`, the policies rebuilt "
            "by `--extract`; a row measured in two runs counts once, at the median of its "
            "runs). Split (`autoprec.hardware.measurements.split_rows`): per model and "
            "execution mode, in order of measured step time, the fastest row and every second "
            "one after it "
            f"fit ({len(fit)} rows), the others are held out ({len(held)} rows); nothing was "
            "tuned on the held-out rows. Fit: `autoprec.hardware.fit.calibrate_from_steps` "
            "(least squares on the log-ratio of predicted to measured time, the factors tied to "
            "their published or "
            f"default values by a weak prior), written to "
            f"`{_shown(args.calibration)}`. Columns: the cost model "
            "as it was (`CostModel.step` without an execution mode, the published factors), "
            'with each row\'s execution mode (`execution="eager"` or `"compiled"`), and '
            "with the mode and the fitted factors.",
            "",
            md_table(header, table_rows),
            "",
            md_table(
                [
                    "prediction",
                    "median abs. error, held-out",
                    "median abs. error, fit rows",
                    "Spearman, llama's 10 rows",
                    "Spearman, held-out llama rows",
                    "Spearman, all held-out rows",
                ],
                summary,
            ),
            "",
            verdict,
            "",
            f"Fitted factors ({result.device.name}; a factor no fit row depends on keeps its "
            "value):",
            "",
            _factors(result.start, result.fitted),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> Result | None:
    args = parse_args(Args, __doc__.splitlines()[0], argv)
    if args.extract:
        device, rows = extract(args)
        note = "written by experiments/calibrate_cost_model.py --extract from " + ", ".join(
            p.name for p in args.runs
        )
        write_measurements(args.steps, device, rows, note)
        print(f"wrote {len(rows)} rows to {args.steps}")
        return None
    result = run(args)
    publish(SECTION, report(args, result), args, path=args.docs)
    return result


if __name__ == "__main__":
    main()
