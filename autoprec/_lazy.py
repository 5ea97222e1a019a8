"""Names a package exports but imports only when first used (PEP 562 ``__getattr__``), so
that importing the package stays cheap (no torch, no mlflow) until a heavy name is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(namespace: dict[str, Any], table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from ``table[name]`` (a module path) and
    keeps it in ``namespace`` (the package's ``globals()``), so that it is imported once.

    Example:
        >>> __getattr__ = lazy_getattr(globals(), {"Evaluator": "autoprec.evaluate.evaluator"})
    """

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        namespace[name] = value
        return value

    return __getattr__
