"""The precision inference engine: layer analysis and per-layer sensitivity.

- :mod:`.analyze`: ``analyze(spec, batch) -> LayerTable`` (FLOPs, bytes, position, geometry).
- :mod:`.grade`: ``sensitivity(spec, data, formats) -> SensitivityTable``.
"""

from autoprec.graph.analyze import FLOP_UNIT, LayerRow, LayerTable, analyze
from autoprec.graph.grade import METHODS, SensitivityTable, sensitivity

__all__ = [
    "FLOP_UNIT",
    "METHODS",
    "LayerRow",
    "LayerTable",
    "SensitivityTable",
    "analyze",
    "sensitivity",
]
