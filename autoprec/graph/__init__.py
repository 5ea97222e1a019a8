"""The layer analysis: the first half of the precision inference engine (the second half,
the sensitivities, is autoprec.sensitivities).

- :mod:`.table`: ``LayerTable``/``LayerRow``, plain data (no torch).
- :mod:`.cache`: tables on disk, under keys computed without torch.
- :mod:`.named`: ``analyze_named`` reads a cached table by model name without torch.
- :mod:`.analyze`: ``analyze(spec, batch) -> LayerTable`` (FLOPs, bytes, position, geometry).
- :mod:`.trace`: the modes that record one training step for it (layers found by parameter).

The table and the cache load with the package; the names that need torch load on first use, so
``from autoprec.graph.table import LayerTable`` does not import torch.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from autoprec._lazy import lazy_getattr
from autoprec.graph.named import analyze_named
from autoprec.graph.table import FLOP_UNIT, LayerRow, LayerTable

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.graph.analyze import AnalysisError, analyze

_LAZY = {
    "AnalysisError": "autoprec.graph.analyze",
    "analyze": "autoprec.graph.analyze",
}

__all__ = [
    "FLOP_UNIT",
    "AnalysisError",
    "LayerRow",
    "LayerTable",
    "analyze",
    "analyze_named",
]


__getattr__ = lazy_getattr(globals(), _LAZY)


class _Package(types.ModuleType):
    """Keeps ``autoprec.graph.analyze`` the function once the submodule of that name is
    imported (the import system sets the package attribute to the submodule)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "analyze" and isinstance(value, types.ModuleType):
            value = value.analyze
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
