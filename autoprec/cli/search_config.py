"""``autoprec search``'s options as a :class:`~autoprec.pipeline.SearchConfig`: the flags, and
``--config`` (a YAML file of the same options, under the command line).

The file is read and every value checked by the library (:mod:`autoprec.pipeline.config`);
here only the flags are mapped onto its fields and the command line wins over the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from autoprec.cli.recipe_options import RECIPE_OPTIONS, recipe_from
from autoprec.pipeline.config import (
    OPTION_RANGES,
    SearchConfig,
    SearchSetupError,
    check_options,
    read_config,
)
from autoprec.training.recipe import TrainingRecipe

__all__ = [
    "OPTION_RANGES",
    "SearchSetupError",
    "check_options",
    "config_from",
    "merge_config",
]


def merge_config(ctx: click.Context, options: dict[str, Any]) -> dict[str, Any]:
    """Options from ``--config`` where the command line left the default, every one checked.

    An option given as null in the file (``budget:`` with nothing after it) keeps its default.
    A value of the wrong type (``budget: true``, ``out: 5``) or out of its range, an unknown
    precision and a storage URL that cannot be opened are refused here, before any work, in
    one line naming the file and line or the flag.
    """
    path = options.pop("config_path")
    lines: dict[str, str] = {}
    if path is not None:
        values, lines = read_config(Path(path))
        aliases = {"model": "model_name"}
        for key, value in values.items():
            name = aliases.get(key, key)
            if name != "recipe" and _from_command_line(ctx, name):
                lines.pop(key)  # the command line wins
                continue
            options[name] = value
            lines[name] = lines.pop(key)
    check_options(options, lines)
    return options


def config_from(options: dict[str, Any]) -> SearchConfig:
    """The :class:`SearchConfig` of merged options (:func:`merge_config`): ``--model`` as
    ``model``, ``--no-mlflow`` as ``mlflow``, the recipe's flags over the file's ``recipe:``."""
    o = dict(options)
    recipe = TrainingRecipe.from_dict(o.pop("recipe", None) or {}, "recipe")
    recipe = recipe_from({name: o.pop(name, None) for name in RECIPE_OPTIONS}, recipe)
    o["model"] = o.pop("model_name")
    o["mlflow"] = not o.pop("no_mlflow")
    return SearchConfig(**o, recipe=recipe)


def _from_command_line(ctx: click.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"
