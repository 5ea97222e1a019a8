"""``autoprec search --config``: a YAML file of the search's options, under the command line.

The file is read as every user file is (:mod:`autoprec._datafile`: bounded size and nesting,
no YAML aliases, one-line errors that quote a short excerpt).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from autoprec._datafile import DataFileError, parse_yaml, read_text
from autoprec._text import EXCERPT_CHARS, excerpt


class SearchSetupError(ValueError):
    """A search cannot start as asked (bad config, precision, output path, ...)."""


def merge_config(ctx: click.Context, options: dict[str, Any]) -> dict[str, Any]:
    """Options from ``--config`` where the command line left the default.

    The file is read as every user file is (:mod:`autoprec._datafile`: bounded size and
    nesting, no YAML aliases, one-line errors that quote a short excerpt); an option given as
    null (``budget:`` with nothing after it) keeps its default.
    """
    path = options.pop("config_path")
    if path is None:
        return options
    source, what = f"config {path}", "config file"
    try:
        doc, line_of = parse_yaml(read_text(Path(path), source, what), source, what)
    except DataFileError as err:
        raise SearchSetupError(str(err)) from None
    if doc is None:
        return options
    if not isinstance(doc, Mapping):
        raise SearchSetupError(
            f"{source} must be a mapping of option: value; got {excerpt(doc)} "
            f"({type(doc).__name__})"
        )
    names = {p.name: p for p in ctx.command.params if p.name != "config_path"}
    aliases = {"model": "model_name"}
    for key, value in doc.items():
        where = f"{source}, line {line_of((key,))}"
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in names:
            valid = sorted({("model" if n == "model_name" else n) for n in names})
            raise SearchSetupError(
                f"{where}: unknown key {excerpt(key)}; valid keys: {', '.join(valid)}"
            )
        if value is None:
            continue
        if isinstance(value, (list, dict)):  # every option takes a single value
            raise SearchSetupError(
                f"{where}: {key}: expected a single value; got {excerpt(value)} "
                f"({type(value).__name__})"
            )
        given = ctx.get_parameter_source(name)
        if given is not None and given.name != "DEFAULT":
            continue  # the command line wins
        param = names[name]
        try:
            options[name] = param.type_cast_value(ctx, value)
        except (click.BadParameter, OverflowError) as err:  # float(10**400) overflows
            short = isinstance(err, click.BadParameter) and len(str(value)) <= EXCERPT_CHARS
            detail = err.message if short else f"{excerpt(value)} is not a valid {param.type.name}"
            raise SearchSetupError(f"{where}: {key}: {detail}") from None
    return options
