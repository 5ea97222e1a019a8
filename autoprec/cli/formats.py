"""``autoprec formats``: the number formats autoprec can emulate."""

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
            "overflow": f.overflow,
        }
        for f in FORMATS.values()
    ]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def formats(as_json: bool) -> None:
    """List the number formats and their limits."""
    rows = _rows()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
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
