"""``SearchConfig``: every setting of a search, frozen and checked; the one home of their defaults.

``autoprec search``'s flags and its ``--config`` YAML both build one; so does a notebook
(``autoprec.SearchConfig(model="mlp", budget=4)``). A value of the wrong type or out of its range
(:data:`OPTION_RANGES`), an unknown agent or precision and a storage URL that cannot be opened
are refused when the config is made, in one line naming the field (the command line names the
flag or the file's line instead).

The YAML file is read as every user file is (:mod:`autoprec._datafile`: bounded size and
nesting, no YAML aliases, one-line errors that quote a short excerpt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec._datafile import DataFileError, parse_yaml, read_text
from autoprec._text import excerpt
from autoprec._values import BUDGET_RANGE, INT32_MAX, SEED_RANGE, NumberRange, is_number, kind
from autoprec.agents.registry import NAMES as AGENT_NAMES
from autoprec.defaults import MAX_BATCH_SIZE, MAX_IMAGE_SIZE, PRICINGS
from autoprec.evaluate.reward import DEFAULT_TOLERANCE, DEFAULT_WEIGHTS
from autoprec.policy.fields import EXECUTION_MODES
from autoprec.training.recipe import RecipeError, TrainingRecipe

if TYPE_CHECKING:  # pragma: no cover
    from autoprec._datafile import LineFinder

#: The Optuna storage of tpe and nsga2 when none is named (a file in the working folder).
DEFAULT_STORAGE = "sqlite:///autoprec-search.db"
#: ``verify=True``: the exported policy, fp32 and the target's AMP trained from scratch for
#: this many steps, with this many seeds from the search's.
SEARCH_VERIFY_STEPS = 50
SEARCH_VERIFY_SEEDS = 2
FIDELITIES = ("short", "full")
TARGET_MODES = ("native", "emulate")
#: The fields that take one of a few names.
CHOICES = {
    "agent": AGENT_NAMES,
    "fidelity": FIDELITIES,
    "target_mode": TARGET_MODES,
    "execution": EXECUTION_MODES,
    "pricing": PRICINGS,
}

#: The range of each numeric option of a search (and of its config file's keys); a field
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
    "train_tokens": NumberRange(low=1, example="1e12"),
    "max_samples": NumberRange(integer=True, low=2, high=INT32_MAX, example="4096"),
}


class SearchSetupError(ValueError):
    """A search cannot start as asked (bad config, precision, output path, ...)."""


@dataclass(frozen=True)
class SearchConfig:
    """Every setting of one search (``autoprec search``'s flags, one field each).

    Example:
        >>> SearchConfig(model="mlp", agent="random", budget=1).budget
        1

    Args:
        model: a model name (see ``autoprec models``) or ``module:factory``.
        dataset: the fine-tuning data (None: the default for the model's task).
        data_dir: the folder of cifar / imagefolder data.
        target: the accelerator optimised for (None: the local GPU, else ``h100-sxm``).
        agent: the search agent (``ppo``, ``tpe``, ``nsga2``, ``random``, ``greedy``).
        budget: real (non-surrogate) policy evaluations the agent may spend.
        fidelity: the fine-tuning length of a real evaluation (``short`` or ``full``).
        steps: fine-tuning steps at short fidelity (None: the evaluator's default).
        accuracy_tolerance: the relative training-loss increase over fp32 above which the
            reward is penalised.
        w_speedup, w_memory, w_accuracy: the reward's weights.
        train_tokens: the production run's length in tokens: sets ``w_accuracy`` to the
            weight that prices a loss increase as the extra tokens that recover it, by
            Chinchilla's fit for the production model's parameters
            (:func:`autoprec.evaluate.reward.chinchilla_accuracy_weight`); None: ``w_accuracy``
            as given. Not with a ``w_accuracy`` other than the default.
        precisions: those the search may choose from, comma-separated (None: every one the
            target runs); a list or tuple of names is joined.
        target_mode: ``native`` (every layer runs natively on the target) or ``emulate``.
        execution: the program production runs, ``compiled`` (``torch.compile``) or ``eager``:
            what is priced (and timed), and the exported ``target.execution``. None: measured,
            compiled on a GPU and eager on the CPU; modelled, the cost model's default.
        pricing: ``auto`` (time on this machine's device when it is the target, else the cost
            model), ``model`` or ``measured`` (:class:`~autoprec.evaluate.EvaluatorConfig`).
        seed: the seed of the warm start, the data order and the agent.
        num_classes, image_size: the fine-tuned model's classes and input size.
        train_batch_size, train_image_size, train_shape: the production batch, image size and
            named shape the costs are predicted for.
        init_weights: a weights file the model starts from (continued training from a
            checkpoint of ``autoprec train`` or a state dict; None: fresh weights); the
            verification (``verify``) starts every run from it too.
        max_samples: the examples the fine-tuning data keeps, train and validation together
            (None: the dataset's own size).
        workers: processes that run evaluations side by side on a CPU (None: automatic).
        out: the best policy's file; pareto_dir: where the Pareto policies go (None: nowhere).
        storage, study_name, resume: the Optuna storage, the search's name, and whether to
            continue the last search of that name.
        verify: then verify the exported policy over short training runs.
        mlflow, tracking_uri, experiment: MLflow logging, its URI and experiment.
        recipe: how the model is trained (the warm start, every fine-tune, the verification).

    Raises:
        SearchSetupError: a field of the wrong type, out of range or unknown (one line naming
            the field).
    """

    model: str
    dataset: str | None = None
    data_dir: str | None = None
    target: str | None = None
    agent: str = "ppo"
    budget: int = 12
    fidelity: str = "short"
    steps: int | None = None
    accuracy_tolerance: float = DEFAULT_TOLERANCE
    w_speedup: float = DEFAULT_WEIGHTS["speedup"]
    w_memory: float = DEFAULT_WEIGHTS["memory"]
    w_accuracy: float = DEFAULT_WEIGHTS["accuracy"]
    train_tokens: float | None = None
    precisions: str | None = None
    target_mode: str = "native"
    execution: str | None = None
    pricing: str = "auto"
    seed: int = 0
    num_classes: int = 10
    image_size: int | None = None
    train_batch_size: int | None = None
    train_image_size: int | None = None
    train_shape: str | None = None
    init_weights: str | None = None
    max_samples: int | None = None
    workers: int | None = None
    out: str = "best_policy.yaml"
    pareto_dir: str | None = None
    storage: str | None = None
    study_name: str | None = None
    resume: bool = False
    verify: bool = False
    mlflow: bool = True
    tracking_uri: str | None = None
    experiment: str | None = None
    recipe: TrainingRecipe = field(default_factory=TrainingRecipe)

    def __post_init__(self) -> None:
        if not isinstance(self.precisions, (str, type(None))):  # a list of names: joined
            object.__setattr__(self, "precisions", ",".join(map(str, self.precisions)))
        for name in ("out", "pareto_dir", "data_dir", "init_weights"):  # a Path is a path
            value = getattr(self, name)
            if isinstance(value, Path):
                object.__setattr__(self, name, str(value))
        if isinstance(self.recipe, Mapping):
            object.__setattr__(self, "recipe", recipe_from(self.recipe, "recipe"))
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in values.items():
            expected = expected_type(name, value)
            if expected is not None and not (value is None and name in _OPTIONAL):
                raise SearchSetupError(f"{name}: expected {expected}; got {kind(value)}")
        check_options(values, {name: name for name in values})
        if self.train_tokens is not None and self.w_accuracy != DEFAULT_WEIGHTS["accuracy"]:
            raise SearchSetupError(
                "train_tokens (--train-tokens) sets the accuracy weight; give it or w_accuracy "
                "(--w-accuracy), not both"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **overrides: Any) -> SearchConfig:
        """A config from ``data`` (the keys of ``--config``: ``model``, ``budget``, ...,
        ``no_mlflow``, and a ``recipe:`` mapping), then ``overrides`` (field names).

        Raises:
            SearchSetupError: an unknown key, a value of the wrong type or range.
        """
        values, _ = read_values(data, "config")
        return cls(**{**_fields_of(values), **overrides})

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> SearchConfig:
        """A config from a ``--config`` YAML file, then ``overrides`` (field names).

        Raises:
            SearchSetupError: the file cannot be read, or holds an unknown key or a bad value
                (one line naming the file and line).
        """
        values, _ = read_config(Path(path))
        return cls(**{**_fields_of(values), **overrides})

    def replace(self, **changes: Any) -> SearchConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


_OPTIONAL = {f.name for f in fields(SearchConfig) if f.default is None}
#: Each field's default (the command line's flags take theirs from here).
DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(SearchConfig) if f.default is not dataclasses.MISSING
}


def config_keys() -> list[str]:
    """The keys a ``--config`` file may hold: the fields, ``mlflow`` spelt ``no_mlflow``."""
    return sorted({f.name for f in fields(SearchConfig)} - {"mlflow"} | {"no_mlflow"})


def _fields_of(values: Mapping[str, Any]) -> dict[str, Any]:
    """Config-file keys (``no_mlflow``) as fields (``mlflow``)."""
    out = dict(values)
    if "no_mlflow" in out:
        out["mlflow"] = not out.pop("no_mlflow")
    return out


def recipe_from(data: Mapping[str, Any], where: str) -> TrainingRecipe:
    """A :class:`TrainingRecipe` from a mapping, its errors as :class:`SearchSetupError`."""
    try:
        return TrainingRecipe.from_dict(data, where)
    except RecipeError as err:
        raise SearchSetupError(str(err)) from None


# --- the config file ---------------------------------------------------------------------------
def read_config(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The values of a ``--config`` YAML file by key, and where each was written
    (``"config F, line N: key"``); a key given as null is left out (it keeps its default).

    Raises:
        SearchSetupError: the file cannot be read, is not a mapping, or holds an unknown key
            or a value of the wrong type (ranges are checked by :func:`check_options`).
    """
    source, what = f"config {path}", "config file"
    try:
        doc, line_of = parse_yaml(read_text(path, source, what), source, what)
    except DataFileError as err:
        raise SearchSetupError(str(err)) from None
    if doc is None:
        return {}, {}
    if not isinstance(doc, Mapping):
        raise SearchSetupError(
            f"{source} must be a mapping of option: value; got {excerpt(doc)} "
            f"({type(doc).__name__})"
        )
    return read_values(doc, source, line_of)


def read_values(
    doc: Mapping[Any, Any], source: str, line_of: LineFinder | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """``doc``'s values by key (``-`` read as ``_``) with where each was written; see
    :func:`read_config`."""
    valid = config_keys()
    values: dict[str, Any] = {}
    lines: dict[str, str] = {}
    for key, value in doc.items():
        where = f"{source}, line {line_of((key,))}" if line_of else source
        name = str(key).replace("-", "_")
        if name not in valid:
            raise SearchSetupError(
                f"{where}: unknown key {excerpt(key)}; valid keys: {', '.join(valid)}"
            )
        if value is None:
            continue
        if name == "recipe":
            if not isinstance(value, Mapping):
                raise SearchSetupError(f"{where}: recipe: expected a mapping; got {kind(value)}")
            values[name] = recipe_from(value, f"{where}: recipe").to_dict()
        else:
            expected = expected_type(name, value)
            if expected is not None:
                raise SearchSetupError(f"{where}: {key}: expected {expected}; got {kind(value)}")
            values[name] = value
        lines[name] = f"{where}: {key}"
    return values, lines


_BOOLS = {"resume", "verify", "mlflow", "no_mlflow"}
_INTS = {n for n, r in OPTION_RANGES.items() if r.integer}
_FLOATS = {n for n, r in OPTION_RANGES.items() if not r.integer}


def expected_type(name: str, value: object) -> str | None:
    """None if ``value`` has the type field ``name`` takes, else what it takes.

    Every field takes one value; a bool is not a number (YAML's ``true`` for a count), and a
    number is not a string (``out: 5``: quote it to mean the file ``5``).
    """
    if name == "recipe":
        return None if isinstance(value, (TrainingRecipe, Mapping)) else "a training recipe"
    if isinstance(value, (list, dict, tuple)):
        return "a single value"
    if name in _BOOLS:
        return None if isinstance(value, bool) else "true or false"
    if name in _INTS:
        return None if is_number(value) and isinstance(value, int) else "an integer"
    if name in _FLOATS:
        return None if is_number(value) else "a number"
    return None if isinstance(value, str) else "a string (quote it)"


# --- the checks --------------------------------------------------------------------------------
def check_options(options: Mapping[str, Any], where: Mapping[str, str] | None = None) -> None:
    """Check every option of :data:`OPTION_RANGES` (and ``precisions``, ``storage``, the
    :data:`CHOICES`) in ``options``, of a search or of any command that shares them
    (``migrate``).

    Args:
        options: option name (``train_batch_size``) to value; None values are not checked.
        where: how to name an option in the error (``"config F, line N: key"``); by default
            its flag (``--train-batch-size``).

    Raises:
        SearchSetupError: one line naming the option and its range.
    """
    where = where or {}
    for name, value in options.items():
        check_value(name, value, where.get(name) or f"--{name.replace('_', '-')}")


def check_value(name: str, value: object, where: str) -> None:
    """Raise :class:`SearchSetupError` unless option ``name``'s value is in its range."""
    if value is None:
        return
    if name in OPTION_RANGES:
        OPTION_RANGES[name].check(value, where, SearchSetupError)
    elif name in CHOICES and value not in CHOICES[name]:
        raise SearchSetupError(
            f"{where}: {excerpt(value)} is not one of {', '.join(CHOICES[name])}"
        )
    elif name == "precisions":
        _check_precisions(value, where)
    elif name == "storage":
        _check_storage(value, where)


def _check_precisions(value: Any, where: str) -> None:
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


def _check_storage(url: Any, where: str) -> None:
    """An Optuna storage URL that SQLAlchemy can parse, of a database it has a driver for."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError, ImportError) as err:
        reason = excerpt(str(err).splitlines()[0] if str(err) else type(err).__name__, 120)
        raise SearchSetupError(
            f"{where}: {excerpt(url)} is not a database URL that can be used ({reason}); "
            f"write e.g. {DEFAULT_STORAGE}"
        ) from None
