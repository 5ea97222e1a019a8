"""``autoprec export POLICY --to STACK --model MODEL --out PATH`` on the zoo's llama."""

from __future__ import annotations

import pytest
import tomllib
import yaml

from autoprec.cli import main
from autoprec.models import load_model
from autoprec.policy import PrecisionPolicy
from autoprec.policy.io import save_policy
from autoprec.stacks.export import export_policy

FFN = "re:layers\\.\\d+\\.feed_forward\\..*"


@pytest.fixture
def policy_file(tmp_path):
    path = tmp_path / "best_policy.yaml"
    save_policy(PrecisionPolicy(default="bf16", layers={FFN: "fp8_rowwise"}), path)
    return path


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("autoprec: error: ")
    return err


@pytest.mark.parametrize("stack", ["torchao", "torchtitan", "accelerate", "lightning", "megatron"])
def test_export_writes_what_the_library_exports(tmp_path, capsys, policy_file, stack):
    recipe = "fp8" if stack == "megatron" else "fp8_rowwise"  # TE has no rowwise recipe
    policy = PrecisionPolicy(default="bf16", layers={FFN: recipe})
    save_policy(policy, policy_file)
    out = tmp_path / "out" / f"{stack}.txt"
    argv = ["export", str(policy_file), "--to", stack, "--model", "llama", "--out", str(out)]
    assert main(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    assert text == export_policy(load_model("llama").module, policy, stack, "best_policy.yaml")
    if stack == "torchtitan":
        section = tomllib.loads(text)["quantize"]["linear"]["float8"]
        attention = [f"attention.{w}" for w in ("wk", "wo", "wq", "wv")]
        assert section == {"recipe_name": "rowwise", "filter_fqns": [*attention, "output"]}
    elif stack == "megatron":
        assert set(yaml.safe_load(text)["configs"]) == {"bf16", "fp8"}
    else:
        compile(text, str(out), "exec")


def test_a_module_the_model_does_not_have_is_one_line_naming_it(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    save_policy(PrecisionPolicy(default="bf16", layers={"layers.0.attention.q_proj": "fp8"}), path)
    out = tmp_path / "out.toml"
    for stack in ("torchao", "torchtitan", "megatron"):
        argv = ["export", str(path), "--to", stack, "--model", "llama", "--out", str(out)]
        err = _one_line_error(capsys, argv)
        assert "layers.0.attention.q_proj" in err and "'layers.0.attention.wq'" in err
    assert not out.exists()


def test_a_recipe_mix_torchtitan_cannot_run_names_the_nearest_policy_and_its_cost(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    layers = {FFN: "fp8_rowwise", "layers.0.attention.wq": "fp8"}
    save_policy(PrecisionPolicy(default="bf16", layers=layers), path)
    argv = ["export", str(path), "--to", "torchtitan", "--model", "llama", "--out", "x.toml"]
    err = _one_line_error(capsys, argv)
    assert "mixes 12 fp8_rowwise, 1 fp8 layers" in err
    assert "puts all 13 at fp8_rowwise (rowwise)" in err
    assert "predicted step" in err and "on h100-sxm at batch 8" in err
