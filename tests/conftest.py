"""Shared by every test: nothing is read from or written to the user's real cache folder."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from disk_fixtures import fill, tmpfs


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


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Callable[[], Path]]:
    """A folder on a 1 MiB tmpfs and a function that fills it up; skipped where a tmpfs cannot
    be mounted (it needs root)."""
    with tmpfs(tmp_path / "tmpfs") as folder:
        yield lambda: fill(folder)


#: Library files this long are reported at the end of a run (a report, not a failure: the
#: layers are what tests/test_architecture.py enforces).
LONG_FILE_LINES = 450


def pytest_terminal_summary(terminalreporter):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    folders = [root / "autoprec", root / "agents", root / "envs", root / "kernels"]
    long = sorted(
        (n, str(p.relative_to(root)))
        for folder in folders
        for p in folder.rglob("*.py")
        if (n := len(p.read_text().splitlines())) >= LONG_FILE_LINES
    )
    if long:
        terminalreporter.write_line(
            f"library files of {LONG_FILE_LINES} lines or more: "
            + ", ".join(f"{path} ({n})" for n, path in reversed(long))
        )
