"""The analysis cache: layer tables on disk, under keys that a torch-free caller can compute.

Entries live under ``$AUTOPREC_CACHE_DIR/analysis`` as ``{"key": [...], "table": {...}}``, one
JSON file named by a digest of its key. There are two kinds of key:

- **by module** (:func:`~autoprec.graph.analyze` with ``cache=True``): the model name, its
  fingerprint (module names, types and parameter shapes), the input and target shapes and dtypes,
  and the torch version. Computing it needs the built module, so torch.
- **by name** (:func:`named_key`, used by :func:`~autoprec.graph.named.analyze_named`): the
  registry name and build arguments, the batch size, the installed torch, torchvision and
  transformers versions (read with ``importlib.metadata``) and a digest of the sources that build
  and analyse models. Computing it needs only the arguments, so a hit costs no torch import:
  ``autoprec hardware estimate`` then runs on the cached table alone.

Both carry :data:`~autoprec.graph.table.TABLE_VERSION`. An entry whose stored key differs from
the one asked for counts as missing: it is recomputed and replaced; one that is not valid JSON
or does not describe a table is discarded with a one-line note, and recomputed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from autoprec.cache import cache_dir
from autoprec.cache import read_entry as cached
from autoprec.cache import write_entry as store
from autoprec.graph.table import TABLE_VERSION, LayerTable

_ROOT = Path(__file__).resolve().parent.parent  # the autoprec package
# what decides a table built by name: the model registry, the choice of tunable layers, the
# analysis itself and the table's layout
_SOURCES = ("models/*.py", "layers.py", "graph/analyze.py", "graph/trace.py", "graph/table.py")
_SOURCES += ("hardware/runnability.py",)  # the rows' kind
_VERSIONED = ("torch", "torchvision", "transformers")


def entry_path(key: list[Any]) -> Path:
    """The cache file of ``key`` (a JSON-ready list)."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]
    return cache_dir() / "analysis" / f"{digest}.json"


def read_entry(key: list[Any]) -> LayerTable | None:
    """The table stored under ``key``; None when missing or stored for another key. A damaged
    entry is discarded with a note (:func:`autoprec.cache.read_entry`)."""

    def read(path: Path) -> LayerTable | None:
        doc = json.loads(path.read_text())
        if doc["key"] != json.loads(json.dumps(key)):  # compared as JSON: tuples become lists
            return None
        return LayerTable.from_dict(doc["table"])

    return cached(entry_path(key), read, "analysis cache entry")


def write_entry(key: list[Any], table: LayerTable) -> None:
    """Store ``table`` under ``key`` (atomically: a reader never sees half a file; a disk that
    cannot take it costs a note)."""
    text = json.dumps({"key": key, "table": json.loads(table.to_json())}, indent=1)
    store(entry_path(key), lambda fh: fh.write(text), what="analysis cache entry")


@functools.cache
def _environment() -> tuple[dict[str, str | None], str]:
    """Installed versions of the libraries that build models, and a digest of our sources."""
    versions: dict[str, str | None] = {}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    digest = hashlib.sha256()
    for pattern in _SOURCES:
        for path in sorted(_ROOT.glob(pattern)):
            digest.update(path.relative_to(_ROOT).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return versions, digest.hexdigest()[:16]


def named_key(
    model: str, batch_size: int, num_classes: int = 1000, image_size: int | None = None
) -> list[Any] | None:
    """The by-name cache key of a registry model; None for a user's ``module:factory`` model,
    whose code autoprec cannot version."""
    name = model.strip()
    if ":" in name:
        return None
    versions, sources = _environment()
    build = {"num_classes": num_classes, "image_size": image_size, "batch_size": batch_size}
    return [TABLE_VERSION, "by-name", name.lower(), build, versions, sources]
