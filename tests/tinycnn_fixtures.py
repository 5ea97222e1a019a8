"""Fixtures for tests that evaluate policies: a private cache, one thread, tinycnn on digits.

Import them into a folder's conftest.py (``from tinycnn_fixtures import ...``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from autoprec.data import load_dataset_for
from autoprec.models import load_model


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def _loaded():
    torch.manual_seed(0)
    spec = load_model("tinycnn", num_classes=10)
    return spec, load_dataset_for(spec, "digits", seed=0)


@pytest.fixture
def spec(_loaded):
    return copy.deepcopy(_loaded[0])  # same initial weights in every test


@pytest.fixture
def data(_loaded):
    return _loaded[1]


def made_up_metrics(**changes):
    """A finite, feasible :class:`~autoprec.evaluate.Metrics` of a model-priced short run;
    ``changes`` replace fields (``loss_delta``, ``speedup``, ...)."""
    from autoprec.evaluate import Metrics

    fields = dict(
        accuracy=0.9, loss=1.0, fp32_accuracy=0.9, fp32_loss=1.0, accuracy_delta=0.0,
        loss_delta=0.0, speedup=1.0, memory_ratio=1.0, speedup_vs_amp=1.0,
        memory_ratio_vs_amp=1.0, step_time_s=0.1, memory_bytes=1, source="model",
    )  # fmt: skip
    return Metrics(**{**fields, **changes})
