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
def calibrate(device: str | None, repeats: int) -> None:
    """Measure this machine's matmul rates and copy bandwidth; the cost model then uses them."""
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
    table = analyze_named(model_name, batch_size, num_classes=num_classes, image_size=image_size)
    result = cost_model.step(
        table, policy, optimizer=optimizer, batch_size=batch_size, memory_format=memory_format
    )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    console = _console()
    console.print(
        f"{table.model} on {device}, batch {batch_size}, {optimizer}, {memory_format}: "
        f"step {result.step_time_s * 1e3:.1f} ms, {result.throughput:,.0f} samples/s, "
        f"memory {result.memory_bytes / 2**30:.2f} GiB"
    )
    console.print("  " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in result.memory.items()))
