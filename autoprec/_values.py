"""One value a user wrote (a policy field, a config key, an option): its type, its range, and how
it is quoted in a message.

:class:`NumberRange` is the one check of every numeric setting, so that ``true`` for a count,
``1.5`` for an integer and ``10**400`` are refused in one line naming the field wherever they
are read (:mod:`autoprec.policy.fields` for policy files, :mod:`autoprec.cli.search_config` for
search options and config keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoprec._text import excerpt
from autoprec.defaults import MAX_BUDGET


def kind(value: object) -> str:
    """A short excerpt of ``value`` with its type, for "got ..." in a message."""
    return f"{excerpt(value)} ({type(value).__name__})"


def is_number(value: object) -> bool:
    """An int or a float, a bool not counting."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: object) -> bool:
    """A number (not a bool) that a float holds finitely; ``10**400`` is not."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the largest float
        return False


#: The largest finite float32: a loss scale above it is infinite in the scaler's fp32 tensor.
FLOAT32_MAX = 3.4028234663852886e38
#: The smallest normal float32: a loss scale below it underflows in the scaler's fp32 tensor.
FLOAT32_TINY = 1.1754943508222875e-38
#: The largest int32: a step count held in an int tensor (the loss scaler's growth tracker).
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class NumberRange:
    """The type and range of a numeric field, checked wherever the field is read.

    Every numeric setting (policy fields, search options, command-line options) is checked by
    one of these, so that ``true``, ``1.5`` for a count and ``10**400`` are refused in one line
    naming the field instead of being taken as 1 or overflowing later.

    Args:
        integer: an int is required (a float such as 2.0 is not one); otherwise any finite int
            or float.
        low, high: the bounds, inclusive unless ``open_low`` / ``open_high``.
        example: a sensible value, shown in the error.

    Example:
        >>> NumberRange(integer=True, low=1).problem(True)
        'an integer >= 1; got True (bool)'
    """

    integer: bool = False
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    example: str | None = None

    def describe(self) -> str:
        """What the field must be, e.g. ``"an integer between 1 and 10,000"``."""
        noun = "an integer" if self.integer else "a number"
        low, high = _shown(self.low), _shown(self.high)
        if self.low is not None and self.high is not None and not (self.open_low or self.open_high):
            text = f"{noun} between {low} and {high}"
        else:
            bounds = []
            if self.low is not None:
                bounds.append(f"{'>' if self.open_low else '>='} {low}")
            if self.high is not None:
                bounds.append(f"{'<' if self.open_high else '<='} {high}")
            text = " and ".join([f"{noun} {bounds[0]}", *bounds[1:]]) if bounds else noun
        return f"{text}, e.g. {self.example}" if self.example else text

    def contains(self, value: object) -> bool:
        """Whether ``value`` has the right type and lies in the range."""
        if self.integer and not (isinstance(value, int) and not isinstance(value, bool)):
            return False
        if not finite(value):
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.open_high else value > self.high):
            return False
        return True

    def problem(self, value: object) -> str | None:
        """None for a good value, else ``"<expected>; got <excerpt> (<type>)<hint>"``."""
        if self.contains(value):
            return None
        hint = "" if self.integer and is_number(value) else yaml_hint(value)
        return f"{self.describe()}; got {kind(value)}{hint}"

    def check(self, value: object, name: str, error: type[ValueError] = ValueError) -> None:
        """Raise ``error("<name> must be ...; got ...")`` unless ``value`` is in the range."""
        problem = self.problem(value)
        if problem is not None:
            raise error(f"{name} must be {problem}")


#: Every command's seeds (search, train, verify): numpy's and Optuna's samplers take 32 bits.
SEED_RANGE = NumberRange(integer=True, low=0, high=2**32 - 1, example="0")
#: A search's budget of real evaluations, for the library's ``search`` and the command alike.
BUDGET_RANGE = NumberRange(integer=True, low=1, high=MAX_BUDGET, example="12")


def _shown(bound: float | None) -> str:
    if bound is None:
        return ""
    if isinstance(bound, int) or float(bound).is_integer() and abs(bound) < 1e15:
        return f"{int(bound):,}"
    return f"{bound:.3g}"


def yaml_hint(value: object) -> str:
    """A hint for '1e5'-style strings, which YAML 1.1 reads as text, and for huge integers."""
    if is_number(value) and not finite(value) and isinstance(value, int):
        return "; it is beyond the largest float (about 1.8e308)"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return "; it is a string (YAML 1.1 needs a dot and a signed exponent: 1.0e+5)"
    return ""
