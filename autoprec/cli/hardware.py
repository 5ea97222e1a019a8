"""``autoprec hardware``: the accelerator database, detection, calibration and estimates."""

from __future__ import annotations

import json

import click


def _console():
    from rich.console import Console

    # no markup: what is printed is data (a reason such as 'pip install "autoprec[fp8]"')
    console = Console(markup=False)
    return console if console.is_terminal else Console(width=140, markup=False)


@click.group()
def hardware() -> None:
    """Accelerators autoprec knows, and what a policy costs on them."""


@hardware.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(as_json: bool) -> None:
    """List the accelerators in the database (dense peak TFLOP/s per format)."""
    from rich.table import Table

    from autoprec.hardware import list_devices

    devices = list_devices()
    if as_json:
        click.echo(json.dumps([_summary(d) for d in devices], indent=2))
        return
    table = Table(title="Accelerators (dense peak TFLOP/s; bandwidth GB/s; memory GB)")
    formats = ("fp32", "tf32", "bf16", "fp16", "fp8", "nvfp4")
    for col in ("name", "vendor", *formats, "GB/s", "GB", "low/wide"):
        table.add_column(col, justify="left" if col in ("name", "vendor", "low/wide") else "right")
    for d in devices:
        rates = [f"{d.peak_tflops[p]:g}" if p in d.peak_tflops else "-" for p in formats]
        table.add_row(
            d.name,
            d.vendor,
            *rates,
            f"{d.memory_bandwidth_gbs:g}",
            f"{d.memory_gb:g}",
            f"{d.preferred.low}/{d.preferred.wide}",
        )
    _console().print(table)


def _summary(d) -> dict:
    return {
        "name": d.name,
        "vendor": d.vendor,
        "full_name": d.full_name,
        "peak_tflops": dict(d.peak_tflops),
        "memory_bandwidth_gbs": d.memory_bandwidth_gbs,
        "memory_gb": d.memory_gb,
        "matmul_tflops": dict(d.matmul_tflops),
        "supported_precisions": list(d.supported_precisions),
        "preferred": {
            "low": d.preferred.low,
            "wide": d.preferred.wide,
            "loss_scaling": d.preferred.loss_scaling,
        },
    }


@hardware.command()
@click.argument("name")
@click.option(
    "--model",
    "model_name",
    default=None,
    help="Also say, per tunable layer of this model, which precisions run natively and why not.",
)
@click.option("--num-classes", type=int, default=1000, show_default=True)
@click.option("--image-size", type=int, default=None)
def show(name: str, model_name: str | None, num_classes: int, image_size: int | None) -> None:
    """Everything the database says about one accelerator, with sources, and what runs on it
    natively (per layer kind and precision: the backend, or why not)."""
    from autoprec.hardware import get_device
    from autoprec.hardware.runnability import describe

    d = get_device(name)
    doc = _summary(d)
    doc["aliases"] = list(d.aliases)
    doc["sources"] = dict(d.sources)
    doc["runnable"] = describe(d)
    if model_name is not None:
        from autoprec.graph import analyze_named

        table = analyze_named(model_name, 1, num_classes=num_classes, image_size=image_size)
        doc["layers"] = describe(d, table)
    click.echo(json.dumps(doc, indent=2))


@hardware.command()
def detect() -> None:
    """The database entry for this machine's accelerator (cpu without one)."""
    from autoprec.hardware import detect as detect_device

    d = detect_device()
    click.echo(f"{d.name}: {d.full_name} (supports {', '.join(d.supported_precisions)})")


@hardware.command()
@click.option("--device", default=None, help="Database entry the measurement stands for.")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option(
    "--from",
    "measurements",
    type=click.Path(dir_okay=False),
    default=None,
    help="Fit the device's factors to the training steps of this measurement file instead of "
    "measuring here (e.g. experiments/results/gpu_validate-h200-steps.json).",
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --from: write the calibration here instead of the device's cache entry.",
)
def calibrate(
    device: str | None, repeats: int, measurements: str | None, output: str | None
) -> None:
    """Measure this machine's matmul rates and copy bandwidth, or (--from) fit the factors to
    measured training steps; the cost model then uses them for that device."""
    if measurements is not None:
        _calibrate_from(measurements, device, output)
        return
    if output is not None:
        raise click.UsageError("--output goes with --from (a local measurement is cached)")
    from autoprec.hardware.calibration import calibrate as run
    from autoprec.hardware.calibration import calibration_path

    result = run(device, repeats=repeats)  # a repeats below 1 is refused in one line
    console = _console()
    for precision, tflops in result.achieved_tflops.items():
        eff = result.compute_efficiency.get(precision)
        share = f" ({eff:.0%} of peak)" if eff is not None else ""
        console.print(f"{precision}: {tflops * 1e3:.1f} GFLOP/s{share}")
    console.print(
        f"copy bandwidth: {result.bandwidth_gbs:.1f} GB/s "
        f"({result.bandwidth_efficiency:.0%} of the database figure)"
    )
    console.print(f"saved {calibration_path(result.device)}")


def _calibrate_from(measurements: str, device: str | None, output: str | None) -> None:
    """``autoprec hardware calibrate --from FILE``: the fit, its held-out errors, the factors."""
    from autoprec.hardware.fit import FitReport, calibrate_from_steps

    report = calibrate_from_steps(measurements, _measured_table, device=device, output=output)
    console = _console()
    before, after = (FitReport.median_abs(e) for e in (report.errors_before, report.errors_after))
    console.print(
        f"{report.device}: fitted to {len(report.fit_rows)} measured steps; "
        f"{len(report.held_out)} held out"
        + (
            f", median |error| {before:.1%} with the published factors, {after:.1%} fitted"
            if before is not None
            else ""
        )
    )
    for key, value in report.fitted.to_dict().items():
        was = getattr(report.start, key)
        if isinstance(value, dict):
            changed = {p: v for p, v in value.items() if abs(v - report.start.compute[p]) > 1e-3}
            if changed:
                console.print(f"  {key}: " + ", ".join(f"{p} {v:.3g}" for p, v in changed.items()))
        elif value != was:
            console.print(f"  {key}: {value:.3g} (was {was:.3g})")
    console.print(f"saved {report.path}")


def _measured_table(row):
    """The layer table of a measured row's model at its batch (built on the meta device)."""
    import torch

    from autoprec.graph import analyze
    from autoprec.models import load_model

    with torch.device("meta"):
        spec = load_model(row.model, **row.build)
    return analyze(spec, row.batch_size, cache=True)


@hardware.command()
@click.option("--model", "model_name", required=True)
@click.option("--device", required=True, help="Target accelerator (see `autoprec hardware list`).")
@click.option("--batch-size", type=int, required=True)
@click.option("--image-size", type=int, default=None)
@click.option("--num-classes", type=int, default=1000, show_default=True)
@click.option("--precision", default=None, help="One precision for every tunable layer.")
@click.option("--policy", "policy_file", type=click.Path(), default=None, help="A policy file.")
@click.option("--optimizer", type=click.Choice(["sgd", "adam"]), default="sgd", show_default=True)
@click.option(
    "--memory-format",
    type=click.Choice(["contiguous", "channels_last"]),
    default="contiguous",
    show_default=True,
    help="Activation layout: contiguous (NCHW, PyTorch's default) or channels_last (NHWC).",
)
@click.option(
    "--execution",
    type=click.Choice(["eager", "compiled"]),
    default=None,
    help="The program that runs: eager, or under torch.compile (casts and element-wise chains "
    "fused). Default: the policy file's target.execution, else eager with torchao's fp8 casts "
    "priced as compiled.",
)
@click.option("--json", "as_json", is_flag=True)
def estimate(
    model_name,
    device,
    batch_size,
    image_size,
    num_classes,
    precision,
    policy_file,
    optimizer,
    memory_format,
    execution,
    as_json,
) -> None:
    """Predicted training-step time, throughput and memory of a model under a policy.

    The layer analysis is cached by model name, batch and image size: a repeated estimate reads
    it back without importing torch.
    """
    if (precision is None) == (policy_file is None):
        raise click.UsageError("give exactly one of --precision and --policy")
    from autoprec.cli.search_config import OPTION_RANGES

    OPTION_RANGES["train_batch_size"].check(batch_size, "--batch-size")
    from autoprec.graph import analyze_named
    from autoprec.hardware import CostModel
    from autoprec.policy.io import load_policy

    cost_model = CostModel(device)  # an unknown device or precision fails before the analysis
    if precision is not None:
        cost_model.rate(precision)
    policy = precision if policy_file is None else load_policy(policy_file)
    if execution is None and policy_file is not None and policy.target is not None:
        execution = policy.target.execution  # the program the file was priced for
    table = analyze_named(model_name, batch_size, num_classes=num_classes, image_size=image_size)
    result = cost_model.step(
        table,
        policy,
        optimizer=optimizer,
        batch_size=batch_size,
        memory_format=memory_format,
        execution=execution,
    )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    console = _console()
    console.print(
        f"{table.model} on {device}, batch {batch_size}, {optimizer}, {memory_format}"
        + (f", {execution}" if execution else "")
        + ": "
        f"step {result.step_time_s * 1e3:.1f} ms, {result.throughput:,.0f} samples/s, "
        f"memory {result.memory_bytes / 2**30:.2f} GiB"
    )
    console.print("  " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in result.memory.items()))
