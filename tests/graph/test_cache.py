"""The analysis cache: entries keyed and checked, tables by model name, imports without torch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from autoprec.graph import analyze, analyze_named
from autoprec.graph.cache import entry_path, named_key, read_entry, write_entry
from autoprec.graph.table import TABLE_VERSION
from autoprec.models import load_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    return tmp_path / "analysis"


def test_entry_round_trip_and_misses(cache):
    table = analyze(load_model("mlp"), 4)
    key = [TABLE_VERSION, "test", [1, 2]]
    assert read_entry(key) is None  # missing
    write_entry(key, table)
    assert read_entry(key) == table
    assert read_entry([TABLE_VERSION, "test", [1, 3]]) is None  # another key, another file
    doc = json.loads(entry_path(key).read_text())
    doc["key"][1] = "other"  # the file of this key, written for another (stale or a collision)
    entry_path(key).write_text(json.dumps(doc))
    assert read_entry(key) is None
    for damaged in ("{not json", "[]", json.dumps({"key": key, "table": {"model": "x"}})):
        entry_path(key).write_text(damaged)
        assert read_entry(key) is None


def test_named_key_covers_what_builds_the_table():
    key = named_key("ResNet50 ", 256, 1000, None)
    assert key == named_key("resnet50", 256, 1000, None)
    assert key[0] == TABLE_VERSION and set(key[4]) == {"torch", "torchvision", "transformers"}
    import torch

    assert torch.__version__.startswith(key[4]["torch"])
    others = [
        named_key("resnet50", 128),
        named_key("resnet50", 256, 10),
        named_key("resnet50", 256, image_size=160),
    ]
    assert len({json.dumps(k) for k in [key, *others]}) == 4
    assert named_key("mymodels:small", 8) is None  # the user's code is not versioned


def test_analyze_named_is_the_analysis_at_that_batch_and_is_cached(cache):
    expected = analyze(load_model("tinycnn", num_classes=10), 16)
    table = analyze_named("tinycnn", 16, num_classes=10)
    assert table == expected and table.batch_size == 16
    key = named_key("tinycnn", 16, 10)
    assert read_entry(key) == expected
    write_entry(key, dataclasses.replace(expected, model="from the cache"))
    assert analyze_named("tinycnn", 16, num_classes=10).model == "from the cache"  # a hit
    entry_path(key).write_text("{broken")  # a damaged entry falls back to the analysis
    assert analyze_named("tinycnn", 16, num_classes=10) == expected
    assert read_entry(key) == expected  # ... and is replaced


def test_unknown_model_raises_model_error(cache):
    from autoprec.models import ModelError

    with pytest.raises(ModelError, match="unknown model"):
        analyze_named("resnet5O", 8)


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_table_cost_model_and_cache_import_without_torch():
    out = _python(
        "import sys\n"
        "import autoprec.hardware, autoprec.graph.cache\n"
        "from autoprec.graph import LayerRow, LayerTable, analyze_named\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert out.strip() == "[]"


def test_analyze_stays_the_function_whatever_is_imported_first():
    out = _python(
        "from autoprec.sensitivities.grade import sensitivity\n"
        "import autoprec.graph.analyze\n"
        "from autoprec.graph import analyze, LayerTable\n"
        "import autoprec\n"
        "print(callable(analyze), analyze.__module__, autoprec.analyze is analyze)\n"
    )
    assert out.split() == ["True", "autoprec.graph.analyze", "True"]
