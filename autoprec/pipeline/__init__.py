"""The search as a library call: ``autoprec.search(autoprec.SearchConfig(model="mlp"))``.

- :mod:`~autoprec.pipeline.config`: :class:`SearchConfig`, every setting of a search, frozen
  and checked (the one home of their defaults; ``autoprec search``'s flags and ``--config``
  YAML build one).
- :mod:`~autoprec.pipeline.run`: :func:`run_search`, the phases of a search (model and data,
  warm start and fp32 reference, sensitivities, tracking, the agent's search, the comparisons
  with AMP and the hand rules, export, verification), told through
  :class:`~autoprec.pipeline.callbacks.SearchCallbacks`.
- :mod:`~autoprec.pipeline.report`: :class:`SearchReport`, what it found, compared and wrote.

The package is named ``pipeline``, not ``search``: ``autoprec.search`` is the function
(:func:`run_search`), and a subpackage of that name would shadow it (``import
autoprec.search`` sets the attribute ``autoprec.search`` to the module) or be shadowed by it.
"""

from __future__ import annotations

from autoprec.pipeline.callbacks import SearchCallbacks
from autoprec.pipeline.config import SearchConfig, SearchSetupError
from autoprec.pipeline.export import SearchExportError
from autoprec.pipeline.report import Comparison, SearchReport
from autoprec.pipeline.run import run_search

search = run_search

__all__ = [
    "Comparison",
    "SearchCallbacks",
    "SearchConfig",
    "SearchExportError",
    "SearchReport",
    "SearchSetupError",
    "run_search",
    "search",
]
