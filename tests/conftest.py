"""Shared by every test: nothing is read from or written to the user's real cache folder."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """A cache folder per test session (tests that need a fresh one set their own)."""
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
