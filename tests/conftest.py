"""Shared by every test: nothing is read from or written to the user's real cache folder."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """A cache folder per test session (tests that need a fresh one set their own)."""
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """One cache for a module's searches: the warm start and sensitivities are computed once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tracked_search_dir(tmp_path, monkeypatch, module_cache):
    """A search run here: the module's cache, one thread, no MLflow URI from the environment;
    mlflow.db, mlruns/ and the Optuna storage land in ``tmp_path``."""
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(module_cache))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path
