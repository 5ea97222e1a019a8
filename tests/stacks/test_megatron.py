"""Megatron-LM / Transformer Engine: the exported ``--te-precision-config-file``.

Transformer Engine does not install on a CPU; megatron-core does, and where it is installed
the file goes through Megatron's own loader, the lookup its GPTModel makes for each module and
TE's per-module config parser (the last test). Always, the file is also checked against their
documented schema, written out below from Megatron-LM's
``megatron/core/quantization/quant_config.py`` (``RecipeConfig``: ``configs`` and ordered
``matchers``, each ``type: glob`` matched with ``fnmatch`` against the module path, the first
match wins, disabled ones skipped) and ``megatron/core/extensions/transformer_engine.py``
(``TEQuantizationParams``: the keys a ``training_recipe`` may have, the ``Fp8Recipe`` and
``Fp4Recipe`` values, fp8 and fp4 exclusive, ``delayed`` refused): the file must pass that
schema, and replaying its matchers over Megatron GPT's module paths must give every layer the
policy's precision.
"""

from __future__ import annotations

import fnmatch

import pytest
import yaml

from autoprec.policy import PolicyMismatchError, PrecisionPolicy
from autoprec.stacks import StackError
from autoprec.stacks.megatron import megatron_export, megatron_name

RECIPE_KEYS = {
    "fp8_quantization_recipe",
    "fp4_quantization_recipe",
    "custom_recipe_factory",
    "fp8_format",
    "override_quantized_autocast",
    "override_nonquantized_autocast",
    "tp_only_amax_red",
}
FP8_RECIPES = {"tensorwise", "blockwise", "mxfp8"}  # Fp8Recipe, less delayed and custom
TE_RECIPE_OF = {  # (fp8 recipe, fp4 recipe) -> what TE runs, as the policy names it
    ("tensorwise", None): "fp8",
    ("blockwise", None): "fp8_block",
    ("mxfp8", None): "mxfp8",
    (None, "nvfp4"): "nvfp4",
    (None, None): "bf16",
}


def _value(recipe: object) -> str | None:
    """A recipe as its name (Megatron's Fp8Recipe and Fp4Recipe are str enums)."""
    return None if recipe is None else getattr(recipe, "value", recipe)


def check_schema(config: dict) -> None:
    assert set(config) == {"configs", "matchers"}
    for body in config["configs"].values():
        assert set(body) == {"transformer_engine_config_type", "training_recipe"}
        assert body["transformer_engine_config_type"] == "TEQuantizationParams"
        recipe = body["training_recipe"]
        assert set(recipe) <= RECIPE_KEYS
        assert recipe.get("fp8_quantization_recipe", "tensorwise") in FP8_RECIPES
        assert recipe.get("fp4_quantization_recipe", "nvfp4") == "nvfp4"
        assert not ("fp8_quantization_recipe" in recipe and "fp4_quantization_recipe" in recipe)
        assert recipe.get("fp8_format", "e4m3") in ("e4m3", "hybrid")
    for matcher in config["matchers"].values():
        assert matcher["type"] == "glob" and matcher["enabled"] is True
        assert matcher["config"] in config["configs"]


def replay(config: dict, path: str) -> str:
    """What TE runs module ``path`` in: the first enabled glob matcher's config."""
    for matcher in config["matchers"].values():
        if matcher.get("enabled", False) and fnmatch.fnmatch(path, matcher["pattern"]):
            recipe = config["configs"][matcher["config"]]["training_recipe"]
            key = (recipe.get("fp8_quantization_recipe"), recipe.get("fp4_quantization_recipe"))
            return TE_RECIPE_OF[key]
    return "the run's default"


def test_the_file_passes_the_schema_and_gives_each_module_the_policys_recipe(tiny):
    names = tiny.names()
    policy = PrecisionPolicy(
        default="nvfp4",
        layers={
            "output": "bf16",
            "re:layers\\.0\\.attention\\..*": "fp8_block",
            "re:layers\\.1\\.feed_forward\\.w[13]": "mxfp8",
            "layers.1.attention.wo": "fp8",
        },
    )
    text = megatron_export(tiny.copy(), policy).yaml("best_policy.yaml")
    assert "--te-precision-config-file" in text.splitlines()[1]
    config = yaml.safe_load(text)
    check_schema(config)
    assert config["configs"]["fp8"]["training_recipe"]["fp8_format"] == "hybrid"
    for name in names:
        assert replay(config, megatron_name(name)) == policy.precision_for(name), name
    # the globs are anchored at the end: block 1's pattern does not take block 11
    assert replay(config, "decoder.layers.11.mlp.linear_fc1") == "the run's default"
    assert replay(config, "module.decoder.layers.1.mlp.linear_fc1") == "mxfp8"


def test_what_megatron_cannot_run_per_module_is_refused(tiny):
    def export(layers):
        return megatron_export(tiny.copy(), PrecisionPolicy(default="bf16", layers=layers))

    with pytest.raises(StackError, match=r"as one GEMM \(decoder.layers.0.self_attention"):
        export({"layers.0.attention.wq": "fp8"})
    with pytest.raises(StackError, match=r"output \(fp8_rowwise\)"):
        export({"output": "fp8_rowwise"})
    with pytest.raises(StackError, match=r"1 layer\(s\) are not: output \(fp32\)"):
        megatron_export(tiny.copy(), PrecisionPolicy(default="bf16", layers={"output": "fp32"}))
    with pytest.raises(PolicyMismatchError, match="layers.0.attention.q_proj"):
        megatron_export(tiny.copy(), PrecisionPolicy(layers={"layers.0.attention.q_proj": "bf16"}))


def test_megatrons_own_parser_gives_each_module_the_policys_recipe(tiny, tmp_path):
    # megatron-core installs on a CPU (Transformer Engine does not): its recipe loader, the
    # lookup GPTModel makes for each module at init, and TE's per-module config parser
    pytest.importorskip("megatron.core.quantization.utils")
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

    policy = PrecisionPolicy(
        default="fp8", layers={"output": "bf16", "re:layers\\.1\\.feed_forward\\..*": "nvfp4"}
    )
    path = tmp_path / "precision.yaml"
    path.write_text(megatron_export(tiny.copy(), policy).yaml("best_policy.yaml"))
    recipe = load_quantization_recipe(str(path))
    for name in tiny.names():
        config = get_quant_config_or_none(megatron_name(name), recipe)
        params = TEQuantizationParams.parse_from_config(config).training_recipe
        key = (_value(params.fp8_quantization_recipe), _value(params.fp4_quantization_recipe))
        assert TE_RECIPE_OF[key] == policy.precision_for(name), name
        assert params.fp8_format == ("hybrid" if key[0] == "tensorwise" else "e4m3")
        assert params.override_nonquantized_autocast == (key != (None, None))
    assert get_quant_config_or_none("decoder.layers.5.mlp.linear_fc1", recipe) is None
