"""``autoprec models``: the models autoprec can load by name."""

from __future__ import annotations

import json

import click


@click.command()
@click.option(
    "--family",
    type=click.Choice(["builtin", "hf", "torchvision"]),
    default=None,
    help="Only this family.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def models(family: str | None, as_json: bool) -> None:
    """List the models loadable by name (your own load as 'package.module:factory')."""
    from autoprec.models import list_models

    rows = list_models(family)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD)
    for column in ("model", "family", "task", "input shape"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        family_text = r["family"] if r["available"] else f"{r['family']} (pip install autoprec[hf])"
        table.add_row(r["name"], escape(family_text), r["task"], str(tuple(r["input_shape"])))
    console = Console()
    if not console.is_terminal:  # piped: rich would assume 80 columns and cut the table
        console = Console(width=120)
    console.print(table)
    shaped = [r for r in rows if r.get("shapes")]
    if shaped:
        console.print("named production shapes, for the cost (--train-shape NAME):")
        for r in shaped:
            for shape, description in r["shapes"].items():
                console.print(f"  {r['name']} {shape}: {description}", highlight=False)
