"""A registry model's layer table by name, through the analysis cache, torch-free on a hit.

``autoprec hardware estimate`` needs the table of a model it may never build: the by-name key
(:func:`~autoprec.graph.cache.named_key`) is computed from the arguments alone, so a cached table
costs no torch import; a miss builds the model and runs :func:`~autoprec.graph.analyze`. It sits
apart from the cache, which ``analyze`` itself reads and writes, and imports ``analyze`` only on
a miss.
"""

from __future__ import annotations

from autoprec.graph.cache import named_key, read_entry, write_entry
from autoprec.graph.table import LayerTable


def analyze_named(
    model: str, batch_size: int, *, num_classes: int = 1000, image_size: int | None = None
) -> LayerTable:
    """The layer table of a model from the registry, at ``batch_size``, through the cache.

    A cached table is read without importing torch. Otherwise the model is built (on the meta
    device when it can be: only shapes matter, and random initialisation is the slow part),
    analysed with :func:`~autoprec.graph.analyze` (``cache=True``) and stored by name.

    Args:
        model: a name :func:`autoprec.models.load_model` knows.
        batch_size: the batch the table is for; the table is measured at this batch, so the
            cost model need not scale it (the traffic of small per-layer tensors such as
            normalisation parameters does not grow with the batch).
        num_classes: size of the classification head.
        image_size: input image side; None keeps the model's default.

    Raises:
        autoprec.models.ModelError: the model cannot be built as asked (unknown name, image size).
    """
    key = named_key(model, batch_size, num_classes, image_size)
    table = read_entry(key) if key is not None else None
    if table is not None:
        return table
    import torch

    from autoprec.graph.analyze import AnalysisError, analyze
    from autoprec.models import load_model

    build = {"num_classes": num_classes, "image_size": image_size}
    try:
        with torch.device("meta"):
            spec = load_model(model, **build)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        spec = load_model(model, **build)  # a model that cannot be built on meta (or a user error)
    try:
        table = analyze(spec, batch_size, cache=True)
    except AnalysisError:  # its forward cannot run on meta: build it for real, run on the CPU
        table = analyze(load_model(model, **build), batch_size, cache=True)
    if key is not None:
        write_entry(key, table)
    return table
