"""Quoting user input in messages: errors quote a short excerpt, they do not echo.

Example:
    >>> excerpt("fp32")
    "'fp32'"
    >>> excerpt("x" * 1000, limit=5)
    "'xxxxx'... (1,000 characters)"
    >>> excerpt("speed\\nup", quote=False)
    'speed\\\\nup'
"""

from __future__ import annotations

import math
import reprlib

EXCERPT_CHARS = 60  # a long qualified module name still fits whole

_LOG10_2 = math.log10(2)


class _Short(reprlib.Repr):
    """``reprlib`` bounded in length and depth, strings and numbers cut at their end."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxstring = self.maxother = self.maxlong = limit
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 4

    def repr_str(self, x: str, level: int) -> str:
        return _clip(x, self.maxstring, quote=True)

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() * _LOG10_2 < self.maxlong:
            return repr(x)
        digits = int(x.bit_length() * _LOG10_2) + 1  # repr() refuses past 4300 digits
        return f"{'-' if x < 0 else ''}an integer of about {digits:,} digits"


def _clip(text: str, limit: int, *, quote: bool) -> str:
    shown = repr(text[:limit])
    shown = shown if quote else shown[1:-1]
    return shown if len(text) <= limit else f"{shown}... ({len(text):,} characters)"


def excerpt(value: object, limit: int = EXCERPT_CHARS, *, quote: bool = True) -> str:
    """A one-line quotation of ``value`` of about ``limit`` characters, for a message.

    A string longer than ``limit`` keeps its first ``limit`` characters and says how long it was;
    control characters are escaped (``\\n``), so the quotation stays on one line. Other values are
    shown as ``repr`` shows them, with long strings and numbers cut and at most a few entries of
    each container and a few levels of nesting, so that quoting a million-entry list or a 50 MB
    string costs a few dozen characters, and the same time.

    Args:
        value: the input to quote.
        limit: characters of a string (or digits of a number) shown.
        quote: put strings in quotes as ``repr`` does; without, the bare (escaped) text, e.g. for
            a key in a dotted field name.
    """
    if isinstance(value, str):
        return _clip(value, limit, quote=quote)
    return _Short(limit).repr(value)
