"""``autoprec formats``: the number formats autoprec can emulate, and the precisions a layer
can train in (their formats, blocks, tensor-core format and the backend that runs them)."""

from __future__ import annotations

import json

import click


def _rows() -> list[dict]:
    from autoprec.kernels import FORMATS

    return [
        {
            "name": f.name,
            "exponent_bits": f.exponent_bits,
            "mantissa_bits": f.mantissa_bits,
            "bias": f.bias,
            "max_finite": f.max_finite,
            "min_normal": f.min_normal,
            "min_subnormal": f.min_subnormal,
            "storage_bytes": f.storage_bytes,
            "has_inf": f.has_inf,
            "has_nan": f.has_nan,
            "overflow": f.overflow,
        }
        for f in FORMATS.values()
    ]


def _precision_rows() -> list[dict]:
    from autoprec.precision import Precision

    return [
        {
            "name": p.value,
            "forward": p.forward_format,
            "backward": p.backward_format,
            "block": p.block_size,
            "hardware": p.hardware,
            "backend": p.run_with[0],
            "recipe": p.run_with[1],
        }
        for p in Precision
    ]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option(
    "--precisions", is_flag=True, help="With --json: the precisions instead of the formats."
)
def formats(as_json: bool, precisions: bool) -> None:
    """List the number formats and their limits, then the precisions a layer can train in."""
    rows = _rows()
    if as_json:
        click.echo(json.dumps(_precision_rows() if precisions else rows, indent=2))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD)
    for column in (
        "format",
        "exp",
        "man",
        "bias",
        "max",
        "min normal",
        "min subn.",
        "bytes",
        "overflow",
    ):
        table.add_column(
            column, justify="left" if column in ("format", "overflow") else "right", no_wrap=True
        )
    for r in rows:
        table.add_row(
            r["name"],
            str(r["exponent_bits"]),
            str(r["mantissa_bits"]),
            str(r["bias"]),
            f"{r['max_finite']:.4g}",
            f"{r['min_normal']:.4g}",
            f"{r['min_subnormal']:.4g}",
            str(r["storage_bytes"]),
            r["overflow"],
        )
    console = Console()
    if not console.is_terminal:  # piped: rich would assume 80 columns and cut the table
        console = Console(width=120)
    console.print(table)
    console.print(_precision_table(table.box))


def _precision_table(box: object) -> object:
    from rich.table import Table

    table = Table(box=box)
    for column in ("precision", "forward", "backward", "block", "cores", "backend", "recipe"):
        table.add_column(column, no_wrap=True)
    for r in _precision_rows():
        block = "-" if r["block"] is None else str(r["block"])
        table.add_row(
            r["name"], r["forward"], r["backward"], block, r["hardware"], r["backend"], r["recipe"]
        )
    return table
