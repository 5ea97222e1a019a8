"""Defaults shared by the library and the command line; importable without torch."""

from __future__ import annotations

# The data every command fine-tunes on when none is named (search, analyze, migrate, train,
# PrecisionEnv): the random-teacher image task, not digits. On digits a warmed-up resnet18 is
# already near its best, its loss sits on a few hard examples, and a short fine-tune ranks
# random policies differently from one batch order to the next; on `teacher` the ranking
# repeats (docs/benchmarks.md, "Policy evaluator", written by experiments/bench_evaluator.py).
DEFAULT_DATASET = "teacher"

# The data of a language model (a token-classification model whose classes are its vocabulary,
# such as the zoo's `llama`) when none is named: next-token prediction on sequences from a
# random recurrent teacher. Other token models keep `tokens`.
LANGUAGE_MODEL_DATASET = "teacher-text"

# Where a search's speed and memory come from (SearchConfig.pricing, EvaluatorConfig.pricing):
# "auto" times them on this machine's device when it is the target, else the cost model prices.
PRICINGS = ("auto", "model", "measured")

# The rounding kernels' compile settings (autoprec.kernels.dispatch reads them at each call):
# AUTOPREC_COMPILE "0" runs the eager kernels only, "1" compiles at the first call, unset or
# empty compiles where it pays; AUTOPREC_COMPILE_PAYBACK and AUTOPREC_COMPILE_BUDGET are seconds.
COMPILE_ENV = "AUTOPREC_COMPILE"
COMPILE_SETTINGS = ("", "0", "1")
COMPILE_SECONDS_ENV = ("AUTOPREC_COMPILE_PAYBACK", "AUTOPREC_COMPILE_BUDGET")


def compile_setting() -> str:
    """``$AUTOPREC_COMPILE``: ``""`` (compile where it pays), ``"0"`` or ``"1"``.

    Raises:
        ValueError: any other value (one line naming the variable).
    """
    import os

    value = os.environ.get(COMPILE_ENV, "")
    if value not in COMPILE_SETTINGS:
        raise ValueError(
            f"{COMPILE_ENV} must be 0 (eager kernels), 1 (compile at once) or unset, got {value!r}"
        )
    return value


def env_seconds(name: str, default: float) -> float:
    """The environment variable ``name`` as a number of seconds >= 0, ``default`` when unset.

    Raises:
        ValueError: not a finite number >= 0 (one line naming the variable).
    """
    import math
    import os

    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return seconds


def check_compile_environment() -> None:
    """Check the compile settings before any work (the command line's first step), so that a
    bad value is a one-line error at once rather than at the first rounding.

    Raises:
        ValueError: as :func:`compile_setting` and :func:`env_seconds`.
    """
    compile_setting()
    for name in COMPILE_SECONDS_ENV:
        env_seconds(name, 0.0)


# The largest search budget (real evaluations) a search accepts: each evaluation is a
# fine-tune of seconds to minutes, so more than this is a mistake (`budget: 10**400`), and the
# agents size their work by the budget before the first evaluation.
MAX_BUDGET = 10_000

# The largest batch size and image side a command accepts, before any memory check: beyond
# them a batch's element count nears what a tensor can index (2**63), and no machine holds it.
MAX_BATCH_SIZE = 2**24
MAX_IMAGE_SIZE = 2**16
