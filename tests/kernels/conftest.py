"""Fixtures for the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["eager", "compiled"])
def backend(request) -> str:
    """Both implementations of the rounding kernel must give identical bits."""
    return request.param
