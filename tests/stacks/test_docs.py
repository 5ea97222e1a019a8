"""The stacks' snippets in README.md and docs/stacks.md run as written, in order, on the CPU:
each ``python`` block is executed in one namespace per page, each ``autoprec`` line of a
``bash`` block through the CLI, and the ``toml`` block shown for torchtitan is what the export
writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml

from autoprec.cli import main

ROOT = Path(__file__).resolve().parents[2]
README_SECTION = "## Use the policy in your training stack"

pytest.importorskip("torchao")


def blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of each fenced block of ``text``, in order."""
    return re.findall(r"```(\w+)\n(.*?)```", text, re.S)


def run_blocks(text: str, where: str) -> dict:
    """Run the python and bash blocks of ``text`` in order; the python namespace."""
    namespace: dict = {}
    for language, code in blocks(text):
        if language == "python":
            exec(compile(code, where, "exec"), namespace)
        elif language == "bash":
            for line in code.splitlines():
                if line.startswith("autoprec "):
                    assert main(shlex.split(line)[1:]) == 0, line
    return namespace


def test_the_readme_section_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    section = (ROOT / "README.md").read_text().split(README_SECTION, 1)[1].split("\n## ")[0]
    namespace = run_blocks(section, "README.md")
    running = namespace["export"].check(namespace["model"])
    assert running["layers.0.feed_forward.w1"].recipe == "tensorwise"
    assert namespace["model"].output.weight.grad is not None
    toml = tomllib.loads((tmp_path / "float8.toml").read_text())
    assert toml["quantize"]["linear"]["float8"]["recipe_name"] == "tensorwise"
    assert "fp8" in yaml.safe_load((tmp_path / "precision.yaml").read_text())["configs"]


def test_docs_stacks_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    from accelerate.state import AcceleratorState

    monkeypatch.chdir(tmp_path)
    text = (ROOT / "docs" / "stacks.md").read_text()
    AcceleratorState._reset_state(True)
    try:
        namespace = run_blocks(text, "docs/stacks.md")
    finally:
        AcceleratorState._reset_state(True)
    out = capsys.readouterr().out
    assert "17 module(s) do not run what the policy says: layers.0.attention.wq" in out
    assert namespace["trainer"].precision == "bf16-mixed"
    shown = dict(blocks(text))["toml"]
    assert tomllib.loads(shown) == tomllib.loads((tmp_path / "float8.toml").read_text())
    assert (tmp_path / "precision.yaml").exists()
