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
