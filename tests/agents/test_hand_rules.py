"""The hand-written rules of ``--agent baseline`` (fp8, NVFP4, fp8 block scaling, MXFP8), on a
llama layer table at llama3-8b's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from autoprec.agents.hand_rules import hand_rule_policies, hand_rules_left_out, head_layer
from autoprec.hardware import get_device
from autoprec.precision import PRECISION_NAMES

pytest.importorskip("torchao.float8")

# (name, K = in_features, N = out_features) of a llama3-8b block
SHAPES = {
    "attention.wq": (4096, 4096),
    "attention.wk": (4096, 1024),
    "attention.wv": (4096, 1024),
    "attention.wo": (4096, 4096),
    "feed_forward.w1": (4096, 14336),
    "feed_forward.w2": (14336, 4096),
    "feed_forward.w3": (4096, 14336),
}
HEAD = ("output", 4096, 128256)


def llama_layers(n_blocks: int = 4, extra: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
    """``(name, K, N)`` of ``n_blocks`` llama blocks (each with the ``extra`` sub-layers, as
    4096 x 8 Linears) and the head."""
    out = []
    for i in range(n_blocks):
        out += [(f"layers.{i}.{n}", k, o) for n, (k, o) in SHAPES.items()]
        out += [(f"layers.{i}.{n}", 4096, 8) for n in extra]
    return [*out, HEAD]


@dataclass
class _Problem:
    """What the rules read of an :class:`~autoprec.agents.Problem`."""

    device: str = "h100-sxm"
    precisions: tuple[str, ...] = PRECISION_NAMES
    rows: list[tuple[str, int, int]] = field(default_factory=llama_layers)
    lacking: dict[str, set[str]] = field(default_factory=dict)  # {layer: precisions it cannot}
    evaluator: SimpleNamespace = field(init=False)
    table: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.evaluator = SimpleNamespace(device=get_device(self.device))
        rows = [SimpleNamespace(name=n, fan_in=k, fan_out=o) for n, k, o in self.rows]
        self.table = SimpleNamespace(rows=rows)

    def layers(self) -> list[str]:
        return [n for n, _, _ in self.rows]

    def choices(self, layer: str) -> list[str]:
        supported = self.evaluator.device.supports
        lacking = self.lacking.get(layer, set())
        return [p for p in self.precisions if supported(p) and p not in lacking]


def kept_high(policy: dict[str, str], low: str) -> set[str]:
    """The layers a rule leaves out of ``low`` (checking they take bf16, AMP's format)."""
    high = {n for n, p in policy.items() if p != low}
    assert {policy[n] for n in high} <= {"bf16"}, policy
    return high


def block(i: int) -> set[str]:
    return {f"layers.{i}.{n}" for n in SHAPES}


def test_each_fp8_rule_is_the_rule_people_write():
    rules = dict(hand_rule_policies(_Problem()))
    assert list(rules) == [
        "torchao-auto-tensorwise",
        "torchao-auto-rowwise",
        "fp8-except-output",
        "fp8-first-last-bf16",
        "deepseek-v3",
    ]
    tensorwise = rules["torchao-auto-tensorwise"]  # K <= 4096 and N <= 1024 stay bf16
    assert tensorwise["layers.1.attention.wk"] == tensorwise["layers.1.attention.wv"] == "bf16"
    assert tensorwise["layers.1.attention.wq"] == tensorwise["output"] == "fp8"
    rowwise = rules["torchao-auto-rowwise"]  # N <= 2048, or N <= 4096 and K <= 2048: bf16
    assert rowwise["layers.0.attention.wk"] == "bf16"
    assert rowwise["layers.0.feed_forward.w1"] == rowwise["layers.0.attention.wq"] == "fp8_rowwise"
    assert kept_high(rules["fp8-except-output"], "fp8") == {"output"}
    megatron = rules["fp8-first-last-bf16"]
    assert kept_high(megatron, "fp8") == block(0) | block(3) | {"output"}


def test_the_4bit_and_block_rules_on_a_4_block_llama():
    problem = _Problem(device="b200")
    rules = dict(hand_rule_policies(problem))
    assert list(rules)[4:] == [
        "all-nvfp4",
        "nvfp4-bf16-tail",
        "nvfp4-first-last-bf16",
        "deepseek-v3",
        "mxfp8-everywhere",
    ]
    assert kept_high(rules["all-nvfp4"], "nvfp4") == set()
    # torchtitan: ceil(4 * 0.15) = 1 block in bf16, and the head
    assert kept_high(rules["nvfp4-bf16-tail"], "nvfp4") == block(3) | {"output"}
    # Megatron's defaults: 1 block at each end, and the head (outside every block)
    assert kept_high(rules["nvfp4-first-last-bf16"], "nvfp4") == block(0) | block(3) | {"output"}
    assert kept_high(rules["deepseek-v3"], "fp8_block") == {"output"}
    assert kept_high(rules["mxfp8-everywhere"], "mxfp8") == set()
    # Megatron-Bridge keeps the last 4 blocks: all of this model's, so it is AMP here
    assert "nvfp4-last4-bf16" not in rules
    assert [name for name, _ in hand_rules_left_out(problem)] == ["nvfp4-last4-bf16"]


@pytest.mark.parametrize(("n_blocks", "tail"), [(4, 1), (6, 1), (7, 2), (32, 5), (36, 6)])
def test_torchtitans_bf16_tail_is_the_ceiling_of_15_percent(n_blocks, tail):
    # torchtitan's nvfp4_bf16_tail_fqns: Llama 3 8B (32 layers) converts layers 0-26, Qwen3 8B
    # (36) layers 0-29 (torchtitan/components/quantization/nvfp4.md)
    problem = _Problem(device="b200", rows=llama_layers(n_blocks))
    policy = dict(hand_rule_policies(problem))["nvfp4-bf16-tail"]
    tail_blocks = set().union(*(block(i) for i in range(n_blocks - tail, n_blocks)))
    assert kept_high(policy, "nvfp4") == tail_blocks | {"output"}


def test_megatron_bridge_keeps_the_last_4_blocks():
    policy = dict(hand_rule_policies(_Problem(device="b200", rows=llama_layers(6))))
    kept = kept_high(policy["nvfp4-last4-bf16"], "nvfp4")
    assert kept == block(2) | block(3) | block(4) | block(5) | {"output"}


def test_deepseek_v3_keeps_the_moe_gating_and_the_head():
    rows = llama_layers(2, extra=("moe.router.gate", "block_sparse_moe.gate"))
    rules = dict(hand_rule_policies(_Problem(device="b200", rows=rows)))
    gates = {
        f"layers.{i}.{n}" for i in range(2) for n in ("moe.router.gate", "block_sparse_moe.gate")
    }
    assert kept_high(rules["deepseek-v3"], "fp8_block") == gates | {"output"}
    assert kept_high(rules["all-nvfp4"], "nvfp4") == set()  # the other rules lower them


def test_a_layer_that_cannot_take_the_format_takes_amp():
    problem = _Problem(
        device="b200", lacking={"output": {"nvfp4"}, "layers.0.attention.wk": {"mxfp8"}}
    )
    rules = dict(hand_rule_policies(problem))
    assert kept_high(rules["all-nvfp4"], "nvfp4") == {"output"}
    assert kept_high(rules["mxfp8-everywhere"], "mxfp8") == {"layers.0.attention.wk"}


def test_rules_need_their_format_on_the_target_and_in_the_precisions():
    h100 = [name for name, _ in hand_rule_policies(_Problem())]  # no nvfp4 or mxfp8 on Hopper
    assert not any("nvfp4" in name or "mxfp8" in name for name in h100)
    assert "deepseek-v3" in h100  # fp8 block scaling runs on Hopper's fp8 tensor cores
    without = _Problem(device="b200", precisions=("fp32", "bf16", "fp8", "mxfp8"))
    names = [name for name, _ in hand_rule_policies(without)]
    assert "deepseek-v3" not in names and not any("nvfp4" in name for name in names)
    assert "mxfp8-everywhere" in names
    assert hand_rule_policies(_Problem(device="a100-80gb-sxm")) == []
    assert hand_rule_policies(_Problem(precisions=("fp32", "bf16"))) == []


def test_a_rule_that_lowers_nothing_is_left_out():
    problem = _Problem()
    problem.table.rows = [SimpleNamespace(name=n, fan_in=64, fan_out=64) for n in problem.layers()]
    names = [name for name, _ in hand_rule_policies(problem)]
    assert "torchao-auto-tensorwise" not in names and "torchao-auto-rowwise" not in names
    assert "fp8-except-output" in names
    left_out = [name for name, _ in hand_rules_left_out(problem)]
    assert left_out == ["torchao-auto-tensorwise", "torchao-auto-rowwise"]


@pytest.mark.parametrize(
    ("names", "head"),
    [
        (["layers.0.attention.wq", "output"], "output"),
        (["model.layers.0.mlp.up_proj", "lm_head", "score"], "lm_head"),  # named, not last
        (["layers.0.attention.output", "fc"], "fc"),  # inside a block: not the head
        (["conv1", "fc1", "fc2"], "fc2"),  # none named: the last layer
    ],
)
def test_the_head_is_the_layer_named_so_outside_the_blocks(names, head):
    assert head_layer(names) == head
