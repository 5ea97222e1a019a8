"""torchtitan: the exported TOML section, read back as torchtitan reads it.

Two oracles. torchtitan's documented rule, written out below from its
``components/quantization/utils.py`` (a Linear is converted when both weight dimensions are
multiples of 16 and no ``filter_fqns`` entry is a substring of its name; torchao converts with
``Float8LinearConfig.from_recipe_name(recipe_name)``), which always runs; and, where torchtitan
0.2 is installed (``pip install --no-deps "torchtitan<0.3" tyro``: the last release that reads a
TOML job config), torchtitan's own config parser and float8 converter. The model so converted
must pass the check and train as ``apply_torchao`` trains it.
"""

from __future__ import annotations

import pytest
import tomllib
import torch
from torch import nn

from autoprec.policy import PolicyMismatchError, PrecisionPolicy
from autoprec.stacks import StackError, apply_torchao, check_stack
from autoprec.stacks.plan import NearestPolicyError
from autoprec.stacks.torchtitan import torchtitan_export


def torchtitans_filter(module: nn.Module, fqn: str, filter_fqns: list[str]) -> bool:
    """torchtitan's ``module_filter_fn`` as its source states it."""
    if not isinstance(module, nn.Linear):
        return False
    dims = module.weight.shape[0] % 16 == 0 and module.weight.shape[1] % 16 == 0
    return dims and not any(f in fqn for f in filter_fqns)


def test_the_toml_converts_what_the_policy_says_and_trains_as_torchao(tiny):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = tiny.names()
    policy = PrecisionPolicy(
        default="fp8_rowwise", layers={"output": "bf16", **{n: "bf16" for n in names if "wk" in n}}
    )
    text = torchtitan_export(tiny.copy(), policy).toml("best_policy.yaml")
    config = tomllib.loads(text)
    assert config["model"]["converters"] == ["quantize.linear.float8"]
    section = config["quantize"]["linear"]["float8"]
    assert section == {"recipe_name": "rowwise", "filter_fqns": ["attention.wk", "output"]}
    assert config["training"]["mixed_precision_param"] == "bfloat16"
    model = tiny.copy()
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(section["recipe_name"]),
        module_filter_fn=lambda m, fqn: torchtitans_filter(m, fqn, section["filter_fqns"]),
    )
    check_stack(model, policy, torch.bfloat16)
    reference = tiny.copy()
    export = apply_torchao(reference, policy)
    context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    assert tiny.train(model, context) == tiny.train(reference, lambda: export.autocast("cpu"))


def test_mixed_recipes_are_refused_with_the_nearest_policy(tiny):
    names = tiny.names()
    policy = PrecisionPolicy(
        default="bf16",
        layers={**{n: "fp8" for n in names if "feed_forward" in n}, names[0]: "fp8_rowwise"},
    )
    with pytest.raises(NearestPolicyError) as err:
        torchtitan_export(tiny.copy(), policy)
    message = str(err.value)
    assert "\n" not in message
    assert "mixes 6 fp8, 1 fp8_rowwise layers" in message
    assert "puts all 7 at fp8 (tensorwise)" in message
    nearest = err.value.nearest
    assert nearest[names[0]] == "fp8" and nearest["output"] == "bf16"
    assert torchtitan_export(tiny.copy(), nearest).recipe_name == "tensorwise"


def test_what_the_substring_rule_cannot_express_is_refused(tiny):
    # torchtitan's filter is a substring test: leaving out `proj` leaves out `out_proj` too
    model = nn.Module()
    model.proj, model.out_proj = nn.Linear(32, 32), nn.Linear(32, 32)
    policy = PrecisionPolicy(default="fp8", layers={"proj": "fp32"})
    with pytest.raises(StackError, match="cannot give out_proj the policy's format"):
        torchtitan_export(model, policy)
    # and it leaves a Linear whose dimensions are not multiples of 16 unconverted, silently
    model.proj = nn.Linear(32, 40)
    with pytest.raises(StackError, match="cannot give proj the policy's format"):
        torchtitan_export(model, PrecisionPolicy(default="fp8"))
    with pytest.raises(StackError, match=r"output \(fp32\)"):
        torchtitan_export(tiny.copy(), PrecisionPolicy(default="bf16", layers={"output": "fp32"}))
    with pytest.raises(PolicyMismatchError, match="layers.0.attention.q_proj"):
        torchtitan_export(tiny.copy(), PrecisionPolicy(layers={"layers.0.attention.q_proj": "fp8"}))


def test_mxfp8_uses_the_mx_converter_and_a_uniform_policy_no_converter(tiny):
    policy = PrecisionPolicy(default="mxfp8", layers={"output": "bf16"})
    config = tomllib.loads(torchtitan_export(tiny.copy(), policy).toml("p.yaml"))
    assert config["model"]["converters"] == ["quantize.linear.mx"]
    assert config["quantize"]["linear"]["mx"] == {
        "recipe_name": "mxfp8_cublas",
        "filter_fqns": ["output"],
    }
    config = tomllib.loads(torchtitan_export(tiny.copy(), PrecisionPolicy()).toml("p.yaml"))
    assert config == {"training": {"mixed_precision_param": "float32"}}


def test_torchtitans_own_parser_and_converter_train_the_policy(tiny, tmp_path):
    # torchtitan 0.2 (the last that reads a TOML job config) installs without its data and
    # logging dependencies; its float8 converter runs on a CPU with `emulate`, which only lifts
    # its sm89 check when a recipe is named (the config is from_recipe_name's)
    pytest.importorskip("torchtitan.config.manager")
    import torch._inductor.config as inductor
    from torchtitan.components.quantization import float8  # noqa: F401 - registers it
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters

    # the rowwise converter sets an inductor switch for the process: inductor's own patch puts
    # it back after (monkeypatch's undo deleted the entry from the config module, so that every
    # later compile failed: "emulate_precision_casts does not exist")
    with inductor.patch(emulate_precision_casts=inductor.emulate_precision_casts):
        names = tiny.names()
        kept = {"output": "bf16", **{n: "bf16" for n in names if "wv" in n}}
        policy = PrecisionPolicy(default="fp8_rowwise", layers=kept)
        path = tmp_path / "job.toml"
        path.write_text(torchtitan_export(tiny.copy(), policy).toml("best_policy.yaml"))
        job = ConfigManager().parse_args(
            ["--job.config_file", str(path), "--quantize.linear.float8.emulate"]
        )
        assert job.training.mixed_precision_param == "bfloat16"
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
        model = tiny.copy()
        build_model_converters(job, dims).convert(model)
        check_stack(model, policy, torch.bfloat16)
        reference = tiny.copy()
        export = apply_torchao(reference, policy)
        context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        assert tiny.train(model, context) == tiny.train(reference, lambda: export.autocast("cpu"))
