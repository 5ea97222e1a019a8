"""The training-recipe options of the commands that train (search, train, verify), written once
so that their names, types and help stay the same everywhere.

:func:`recipe_options` adds ``--optimizer``, ``--lr``, ``--momentum``, ``--weight-decay``,
``--warmup-steps`` and ``--schedule``, each defaulting to None (the command's own recipe);
:func:`recipe_from` turns what was given into a :class:`~autoprec.training.recipe.TrainingRecipe`
over that default, refusing a bad value in one line that names the flag.

Example::

    @click.command()
    @recipe_options
    def train(**o):
        recipe = recipe_from(o, TrainingRecipe(), o["batch_size"])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from autoprec.training.recipe import OPTIMIZERS, SCHEDULES, RecipeError, TrainingRecipe

F = TypeVar("F", bound=Callable[..., Any])

#: The recipe fields the options set (``--weight-decay`` is ``weight_decay``); ``batch_size``
#: comes from each command's own ``--batch-size``.
RECIPE_OPTIONS = ("optimizer", "lr", "momentum", "weight_decay", "warmup_steps", "schedule")


def flag(field: str) -> str:
    """The command-line spelling of a recipe field: ``weight_decay`` -> ``--weight-decay``."""
    return "--" + field.replace("_", "-")


def recipe_options(command: F | None = None, *, lr_help: str | None = None) -> Any:
    """Add the recipe's options to a click command (each None unless given); with only
    ``lr_help`` (what ``--lr`` defaults to for this command), the decorator that does so."""
    if command is None:
        return lambda command: recipe_options(command, lr_help=lr_help)
    options = [
        click.option(
            "--optimizer",
            type=click.Choice(OPTIMIZERS),
            default=None,
            help="Training optimizer: sgd (with --momentum) or adamw (default: sgd).",
        ),
        click.option("--lr", type=float, default=None, help="Peak learning rate (default: 0.05)."),
        click.option("--momentum", type=float, default=None, help="SGD's momentum (default: 0.9)."),
        click.option(
            "--weight-decay",
            type=float,
            default=None,
            help="SGD's L2 penalty or AdamW's decoupled weight decay (default: 0).",
        ),
        click.option(
            "--warmup-steps",
            type=int,
            default=None,
            help="Steps of linear warm-up from 0 to --lr (default: 0).",
        ),
        click.option(
            "--schedule",
            type=click.Choice(SCHEDULES),
            default=None,
            help="The rate after the warm-up: constant, or cosine or linear decay to 0 at the "
            "last step (default: constant).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def recipe_from(
    options: Mapping[str, Any], default: TrainingRecipe, batch_size: int | None = None
) -> TrainingRecipe:
    """``default`` with the recipe options that were given (not None) and ``batch_size``.

    Raises:
        RecipeError: a value the recipe refuses (one line naming its flag), or ``--momentum``
            given with ``--optimizer adamw`` (AdamW has no momentum: its ``beta1`` plays it).
    """
    given = {name: options[name] for name in RECIPE_OPTIONS if options.get(name) is not None}
    if batch_size is not None:
        given["batch_size"] = batch_size
    optimizer = given.get("optimizer", default.optimizer)
    if optimizer == "adamw" and "momentum" in given:
        raise RecipeError(
            "--momentum is SGD's; AdamW has none (its beta1 is 0.9): drop --momentum or use "
            "--optimizer sgd"
        )
    try:
        return dataclasses.replace(default, **given)
    except RecipeError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        if field in given:  # "lr must be ..." -> "--lr must be ..."
            message = flag(field) + message[len(field) :]
        raise RecipeError(message) from None
