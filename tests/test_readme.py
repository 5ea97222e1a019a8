"""The README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_block_after(heading: str) -> str:
    text = README.read_text()
    section = text.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_policy_training_loop_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = python_block_after("## Use a policy in your own training loop")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert (tmp_path / "policy.yaml").read_text().startswith("autoprec_policy: 1")
    out = capsys.readouterr().out
    assert "'0': <Precision.BF16: 'bf16'>" in out and "'2': <Precision.FP32: 'fp32'>" in out
    assert namespace["handle"].removed
    assert namespace["scaler"].summary()["updates"] == 20


def test_kernel_example_runs():
    exec(compile(python_block_after("## Use the kernels"), "README.md", "exec"), {})
