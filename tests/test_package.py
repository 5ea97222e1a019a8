"""The distribution's layout: envs/, agents/ and kernels/ install as autoprec subpackages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import autoprec

ROOT = Path(__file__).resolve().parent.parent


def test_subpackages_import_from_their_top_level_folders():
    import autoprec.agents
    import autoprec.envs
    import autoprec.kernels

    for module, folder in [
        (autoprec.kernels, "kernels"),
        (autoprec.envs, "envs"),
        (autoprec.agents, "agents"),
    ]:
        assert Path(module.__file__).parent.name == folder


def test_public_api_is_exported_on_purpose():
    for name in autoprec.__all__:
        assert not name.startswith("_") or name == "__version__"
        assert getattr(autoprec, name) is not None
    assert autoprec.quantize is autoprec.kernels.quantize
    with pytest.raises(AttributeError):
        autoprec.not_a_name  # noqa: B018


def test_import_autoprec_does_not_import_torch():
    code = "import sys, autoprec, autoprec.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_wheel_maps_the_folders_into_autoprec(tmp_path):
    """`pip install .` installs from this wheel; check what it carries."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("autoprec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # every source module, at its installed path
    for folder, package in [
        ("autoprec", "autoprec"),
        ("kernels", "autoprec/kernels"),
        ("envs", "autoprec/envs"),
        ("agents", "autoprec/agents"),
    ]:
        for source in (ROOT / folder).rglob("*.py"):
            installed = f"{package}/{source.relative_to(ROOT / folder).as_posix()}"
            assert installed in names, f"{source} is missing from the wheel (pyproject packages?)"
    assert "autoprec/hardware/devices.yaml" in names  # package data: the accelerator database
    assert not any(n.startswith(("kernels/", "envs/", "agents/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "autoprec = autoprec.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = 'pip install -e ".[dev]" && pytest'
    assert command in readme and command in ci
