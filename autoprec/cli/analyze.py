"""``autoprec analyze``: the layer table of a model, with per-layer precision sensitivities."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from autoprec._text import excerpt
from autoprec.cache import write_output
from autoprec.cli._setup import SMALL_IMAGE, train_shape_option
from autoprec.defaults import DEFAULT_DATASET
from autoprec.sensitivities.budget import DEFAULT_TIME_BUDGET_S, check_budget

if TYPE_CHECKING:
    from rich.table import Table

    from autoprec.graph import LayerTable
    from autoprec.sensitivities import SensitivityTable


class AnalyzeOptionError(ValueError):
    """An option of ``autoprec analyze`` has a value it cannot use."""


def _time_budget(text: str | None) -> float:
    """``--time-budget`` in seconds (the default when not given).

    Raises:
        AnalyzeOptionError: not a positive, finite number (one line, quoting the value).
    """
    if text is None:
        return DEFAULT_TIME_BUDGET_S
    try:
        return check_budget(float(text))
    except ValueError:
        raise AnalyzeOptionError(
            f"--time-budget {excerpt(text)}: expected a positive number of seconds, such as "
            f"{DEFAULT_TIME_BUDGET_S:.0f}"
        ) from None


class AnalyzeOutputError(ValueError):
    """An output file of ``autoprec analyze`` (``--json``, ``--heatmap``) cannot be written."""


def _check_outputs(paths: dict[str, str | None]) -> None:
    """Raise :class:`AnalyzeOutputError` if an output file is a folder or its folder cannot be
    written."""
    from autoprec.cli._setup import check_writable

    for option, path in paths.items():
        if path:
            if Path(path).is_dir():
                raise AnalyzeOutputError(f"{option} {path}: is a folder; give a file's path")
            check_writable([Path(path).absolute().parent], AnalyzeOutputError, f"{option} {path}: ")


def _heatmap(table, sens, path: Path) -> None:
    """PNG: layers (rows, in execution order) x precisions, coloured by log10(1 - cosine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    d = np.array(sens.matrix("grad_distance"), dtype=float)
    with np.errstate(divide="ignore"):
        logd = np.log10(np.clip(d, 1e-16, None))
    fig, ax = plt.subplots(figsize=(2 + 1.1 * len(sens.precisions), 1.5 + 0.22 * len(sens.layers)))
    im = ax.imshow(logd, aspect="auto", cmap="magma_r", vmin=-12, vmax=0)
    ax.set_xticks(range(len(sens.precisions)), sens.precisions)
    ax.set_yticks(range(len(sens.layers)), sens.layers, fontsize=7)
    ax.set_title(f"{table.model}: gradient damage per layer ({sens.method})")
    fig.colorbar(im, ax=ax, label="log10(1 - gradient cosine to fp32)")
    fig.tight_layout()
    try:
        write_output(
            path, lambda fh: fig.savefig(fh, format="png", dpi=110), binary=True, what="heatmap"
        )
    finally:
        plt.close(fig)


def _sensitivity_summary(sens, data_name: str) -> str:
    """The last line about the sensitivities: the method, what it measured, the time."""
    what = sens.method
    if sens.method == "focused":
        swept = sum(sens.measured)
        what += f" ({swept} of {len(sens.layers)} layers swept; ~: interpolated, not measured)"
    elif sens.method == "taylor":
        what += " (~: estimated, not measured)"
    return (
        f"sensitivity: {what} on {data_name}, {sens.wall_time_s:.1f} s (1-cos: one minus the "
        "cosine of the full gradient to fp32's, float64)"
    )


def _inputs(row) -> str:
    """Where a layer's input comes from: its source layers ("input": the model's input)."""
    names = ["input" if s == "" else s for s in row.sources]
    return names[-1] if len(names) == 1 else f"{names[-1]} +{len(names) - 1}" if names else ""


def _native(verdicts: dict[str, str], reasons: list[str]) -> str:
    """The precisions a layer cannot run natively, each with a footnote number ("all": none)."""
    missing = []
    for precision, verdict in verdicts.items():
        if verdict.startswith("no: "):
            why = verdict[4:]
            if why not in reasons:
                reasons.append(why)
            missing.append(f"{precision}[{reasons.index(why) + 1}]")
    return "all" if not missing else "not " + " ".join(missing)


def _coverage(table) -> str:
    """One line: the share of the forward FLOPs that no tunable layer covers, and why."""
    if not table.uncovered:
        return "every matrix operation of the forward pass is in a tunable layer"
    parts = "; ".join(f"{reason}: {flops / 1e9:.4f} GFLOP" for reason, flops in table.uncovered)
    return (
        f"left out of the tunable layers: {table.uncovered_share:.1%} of the forward FLOPs "
        f"({parts})"
    )


def _layer_view(
    model: str,
    table: LayerTable,
    runnable: dict[str, dict[str, str]],
    device: str,
    sens: SensitivityTable | None,
    reasons: list[str],
) -> Table:
    """The table of layers shown: one row per tunable layer, its sizes, where its input comes
    from, the precisions it cannot run natively on ``device`` (their footnotes appended to
    ``reasons``) and its sensitivities."""
    from rich.table import Table

    out = Table(
        title=f"{model}: {len(table)} tunable layers, batch {table.batch_size}, "
        f"input {tuple(table.input_shape)}; FLOPs in GFLOP (2 per multiply-add)",
        caption="input: the last tunable layer feeding it (+ how many more; input: the model's)",
    )
    native = f"native on {device}"
    columns = ("#", "layer", "type", "kind", "params", "fwd GFLOP", "bwd GFLOP", "act MB", "input")
    for col in (*columns, native):
        out.add_column(
            col, justify="left" if col in ("layer", "type", "kind", "input", native) else "right"
        )
    shown = [p for p in sens.precisions if p != "fp32"] if sens is not None else []
    for p in shown:
        out.add_column(f"1-cos {p}", justify="right")
    for row in table:
        cells = [
            str(row.index),
            row.name,
            row.type,
            row.kind,
            f"{row.params:,}",
            f"{row.forward_flops / 1e9:.4f}",
            f"{row.backward_flops / 1e9:.4f}",
            f"{(row.input_bytes + row.output_bytes) / 1e6:.2f}",
            _inputs(row),
            _native(runnable[row.name], reasons),
        ]
        mark = "" if sens is None or sens.is_measured(row.name) else "~"
        cells += [f"{mark}{sens.distance(row.name, p):.1e}" for p in shown]
        out.add_row(*cells)
    return out


def _write_json(
    path: str,
    table: LayerTable,
    sens: SensitivityTable | None,
    device: str,
    runnable: dict[str, dict[str, str]],
) -> None:
    """``--json``: the layer table, the sensitivities (null without them) and the runnability."""
    doc = json.loads(table.to_json())
    doc["sensitivity"] = None if sens is None else sens.to_dict()
    doc["runnable"] = {"device": device, "layers": runnable}
    text = json.dumps(doc, indent=2) + "\n"
    write_output(path, lambda fh: fh.write(text), what="analysis")


@click.command()
@click.option("--model", "model_name", required=True, help="Model name (see `autoprec models`).")
@click.option(
    "--dataset",
    default=None,
    help=f"Data for the sensitivities (default: {DEFAULT_DATASET}; tokens for token models).",
)
@click.option(
    "--data-dir", type=click.Path(), default=None, help="Folder of cifar10/imagefolder data."
)
@click.option(
    "--download", is_flag=True, help="Allow downloading cifar10/cifar100 into --data-dir."
)
@click.option("--num-classes", type=int, default=10, show_default=True)
@click.option(
    "--image-size",
    type=int,
    default=None,
    help=f"Input size for image models (default {SMALL_IMAGE}, which keeps a CPU analysis quick; "
    "token models take none).",
)
@train_shape_option
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--batches", type=int, default=4, show_default=True)
@click.option("--precisions", default="fp32,tf32,bf16,fp16,fp8", show_default=True)
@click.option(
    "--method",
    type=click.Choice(["auto", "sweep", "focused", "taylor"]),
    default="auto",
    show_default=True,
    help="sweep: every layer at every precision, measured; taylor: a one-pass estimate; "
    "focused: the sweep of as many layers as fit --time-budget, a layer of each role in the "
    "repeated blocks first, the rest interpolated (marked ~); auto: the most accurate that fits.",
)
@click.option(
    "--time-budget",
    "time_budget",
    metavar="SECONDS",
    default=None,
    help=f"Seconds for the sensitivities, fp32 warm-up included, for auto and focused "
    f"(default {DEFAULT_TIME_BUDGET_S:.0f}).",
)
@click.option("--no-sensitivity", is_flag=True, help="Only the layer table (FLOPs, bytes).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--json", "json_path", type=click.Path(), default=None, help="Write everything as JSON."
)
@click.option("--heatmap", type=click.Path(), default=None, help="PNG of layers x precisions.")
@click.option(
    "--target",
    default=None,
    help="Accelerator whose native runnability is shown per layer (default: the local GPU; "
    "without one, h100-sxm).",
)
def analyze(
    model_name,
    dataset,
    data_dir,
    download,
    num_classes,
    image_size,
    train_shape,
    batch_size,
    batches,
    precisions,
    method,
    time_budget,
    no_sensitivity,
    seed,
    json_path,
    heatmap,
    target,
) -> None:
    """Analyse a model's tunable layers and grade each one's need for precision, and say which
    precisions each layer can train in natively on the target (and why not)."""
    _check_outputs({"--json": json_path, "--heatmap": heatmap})  # before any model work
    budget = _time_budget(time_budget)
    from rich.console import Console

    from autoprec.cli._setup import production_spec, resolve_target
    from autoprec.cli.sensitivity_progress import sensitivity_progress
    from autoprec.data import load_dataset_for
    from autoprec.graph import analyze as analyze_model
    from autoprec.hardware.runnability import describe
    from autoprec.models import load_model, model_task
    from autoprec.sensitivities import sensitivity

    device, _ = resolve_target(target)
    if image_size is None and model_task(model_name) in (None, "image-classification"):
        image_size = SMALL_IMAGE  # a user factory (task unknown until built) is offered it too
    spec = load_model(model_name, num_classes=num_classes, image_size=image_size)
    # the layer table at the production shape if named (same layer names), on the meta device
    table = analyze_model(production_spec(spec, model_name, num_classes, train_shape), batch_size)
    runnable = describe(device, table)
    reasons: list[str] = []  # footnotes of the "native" column
    sens = None
    if not no_sensitivity:
        data = load_dataset_for(spec, dataset, root=data_dir, download=download, seed=seed)
        formats = [p.strip() for p in precisions.split(",") if p.strip()]
        err = Console(stderr=True)
        with sensitivity_progress(err, f"sensitivity on {data.name}") as (progress, on_plan):
            sens = sensitivity(
                spec,
                data,
                formats,
                batches,
                batch_size=batch_size,
                method=method,
                time_budget_s=budget,
                seed=seed,
                progress=progress,
                on_plan=on_plan,
            )
    console = Console(markup=False)  # data, not markup: 'pip install "autoprec[fp8]"' stays
    if not console.is_terminal:
        console = Console(width=160, markup=False)
    out = _layer_view(spec.name, table, runnable, device.name, sens, reasons)
    console.print(out)
    console.print(
        f"total forward: {table.total_forward_flops / 1e9:.3f} GFLOP "
        f"({table.flop_unit}) for batch {table.batch_size}"
    )
    console.print(_coverage(table), highlight=False)
    for i, reason in enumerate(reasons, 1):
        console.print(f"  [{i}] {reason}", highlight=False)
    if table.meta_failure:
        console.print(
            f"ran on the CPU at the analysed shapes: the meta-device pass failed in "
            f"{table.meta_failure}",
            highlight=False,
        )
    if sens is not None:
        console.print(_sensitivity_summary(sens, data.name), highlight=False, soft_wrap=True)
    if json_path:
        _write_json(json_path, table, sens, device.name, runnable)
        console.print(f"wrote {json_path}")
    if heatmap and sens is not None:
        _heatmap(table, sens, Path(heatmap))
        console.print(f"wrote {heatmap}")
