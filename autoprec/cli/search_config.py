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
from autoprec._values import BUDGET_RANGE, INT32_MAX, SEED_RANGE, NumberRange, is_number, kind
from autoprec.defaults import MAX_BATCH_SIZE, MAX_IMAGE_SIZE

#: The range of each numeric option of ``search`` (and of its config file's keys); an option
#: left at None (its default is computed) is not checked.
OPTION_RANGES = {
    "budget": BUDGET_RANGE,
    "steps": NumberRange(integer=True, low=1, high=INT32_MAX, example="50"),
    "seed": SEED_RANGE,
    "num_classes": NumberRange(integer=True, low=1, high=INT32_MAX, example="10"),
    "image_size": NumberRange(integer=True, low=1, high=MAX_IMAGE_SIZE, example="32"),
    "train_image_size": NumberRange(integer=True, low=1, high=MAX_IMAGE_SIZE, example="224"),
    "train_batch_size": NumberRange(integer=True, low=1, high=MAX_BATCH_SIZE, example="256"),
    "workers": NumberRange(integer=True, low=0, high=1024, example="2"),
    "accuracy_tolerance": NumberRange(low=0, example="0.01"),
    "w_speedup": NumberRange(low=0, example="1.0"),
    "w_memory": NumberRange(low=0, example="0.5"),
    "w_accuracy": NumberRange(low=0, example="1.0"),
}


class SearchSetupError(ValueError):
    """A search cannot start as asked (bad config, precision, output path, ...)."""


def merge_config(ctx: click.Context, options: dict[str, Any]) -> dict[str, Any]:
    """Options from ``--config`` where the command line left the default, every one checked.

    The file is read as every user file is (:mod:`autoprec._datafile`: bounded size and
    nesting, no YAML aliases, one-line errors that quote a short excerpt); an option given as
    null (``budget:`` with nothing after it) keeps its default. A value of the wrong type
    (``budget: true``, ``out: 5``) or out of its range (:data:`OPTION_RANGES`), an unknown
    precision and a storage URL that cannot be opened are refused here, before any work, in
    one line naming the file and line or the flag.
    """
    path = options.pop("config_path")
    lines: dict[str, str] = {}
    if path is not None:
        lines = _read_config(ctx, Path(path), options)
    check_options(options, lines)
    return options


def check_options(options: dict[str, Any], where: dict[str, str] | None = None) -> None:
    """Check every option of :data:`OPTION_RANGES` (and ``precisions``, ``storage``) in
    ``options``, of ``search`` or of any command that shares them (``migrate``).

    Args:
        options: option name (``train_batch_size``) to value; None values are not checked.
        where: how to name an option in the error (``"config F, line N: key"``); by default
            its flag (``--train-batch-size``).

    Raises:
        SearchSetupError: one line naming the option and its range.
    """
    where = where or {}
    for name, value in options.items():
        _check_value(name, value, where.get(name) or f"--{name.replace('_', '-')}")


def _from_command_line(ctx: click.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def _read_config(ctx: click.Context, path: Path, options: dict[str, Any]) -> dict[str, str]:
    """Put the config file's values into ``options`` where the command line left the default;
    returns each option it set with where it was written (``"config F, line N: key"``)."""
    source, what = f"config {path}", "config file"
    try:
        doc, line_of = parse_yaml(read_text(path, source, what), source, what)
    except DataFileError as err:
        raise SearchSetupError(str(err)) from None
    if doc is None:
        return {}
    if not isinstance(doc, Mapping):
        raise SearchSetupError(
            f"{source} must be a mapping of option: value; got {excerpt(doc)} "
            f"({type(doc).__name__})"
        )
    names = {p.name: p for p in ctx.command.params if p.name != "config_path"}
    aliases = {"model": "model_name"}
    lines: dict[str, str] = {}
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
        if _from_command_line(ctx, name):
            continue  # the command line wins
        param = names[name]
        expected = _expected_type(param, value)
        if expected is not None:
            raise SearchSetupError(f"{where}: {key}: expected {expected}; got {kind(value)}")
        try:
            options[name] = param.type_cast_value(ctx, value)
        except (click.BadParameter, OverflowError) as err:  # float(10**400) overflows
            short = isinstance(err, click.BadParameter) and len(str(value)) <= EXCERPT_CHARS
            detail = err.message if short else f"{excerpt(value)} is not a valid {param.type.name}"
            raise SearchSetupError(f"{where}: {key}: {detail}") from None
        lines[name] = f"{where}: {key}"
    return lines


def _expected_type(param: click.Parameter, value: object = None) -> str | None:
    """None if ``value`` (from a config file) has the type ``param`` takes, else what it takes.

    Every option takes one value; a bool is not a number (YAML's ``true`` for a count), and a
    number is not a string (``out: 5``: quote it to mean the file ``5``).
    """
    kind_of = param.type
    if isinstance(value, (list, dict)):
        return "a single value"
    if isinstance(param, click.Option) and param.is_flag:
        return None if isinstance(value, bool) else "true or false"
    if isinstance(kind_of, click.types.IntParamType):
        return None if is_number(value) and isinstance(value, int) else "an integer"
    if isinstance(kind_of, click.types.FloatParamType):
        return None if is_number(value) else "a number"
    return None if isinstance(value, str) else "a string (quote it)"


def _check_value(name: str, value: object, where: str) -> None:
    """Raise :class:`SearchSetupError` unless option ``name``'s value is in its range."""
    if value is None:
        return
    if name in OPTION_RANGES:
        OPTION_RANGES[name].check(value, where, SearchSetupError)
    elif name == "precisions":
        _check_precisions(value, where)
    elif name == "storage":
        _check_storage(value, where)


def _check_precisions(value: str, where: str) -> None:
    """A comma-separated list of precision names; which the target runs is checked once the
    target is known."""
    from autoprec.precision import PRECISION_NAMES, parse_precision

    names = [p.strip() for p in value.split(",") if p.strip()]
    if not names:
        raise SearchSetupError(
            f"{where} names no precision; give some of {', '.join(PRECISION_NAMES)}, "
            "comma-separated"
        )
    for name in names:
        try:
            parse_precision(name)
        except ValueError:
            raise SearchSetupError(
                f"{where}: unknown precision {excerpt(name)}; expected some of "
                f"{', '.join(PRECISION_NAMES)}, comma-separated"
            ) from None


def _check_storage(url: str, where: str) -> None:
    """An Optuna storage URL that SQLAlchemy can parse, of a database it has a driver for."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError, ImportError) as err:
        reason = excerpt(str(err).splitlines()[0] if str(err) else type(err).__name__, 120)
        raise SearchSetupError(
            f"{where}: {excerpt(url)} is not a database URL that can be used ({reason}); "
            "write e.g. sqlite:///autoprec-search.db"
        ) from None
