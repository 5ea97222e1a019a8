"""The hand-written fp8 rules of ``--agent baseline``, on a llama3-8b-shaped layer table."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from autoprec.agents.hand_rules import hand_rule_policies
from autoprec.hardware import get_device
from autoprec.precision import PRECISION_NAMES

pytest.importorskip("torchao.float8")

# (name, K = in_features, N = out_features) of three llama3-8b blocks and the head
SHAPES = {
    "attention.wq": (4096, 4096),
    "attention.wk": (4096, 1024),
    "attention.wv": (4096, 1024),
    "attention.wo": (4096, 4096),
    "feed_forward.w1": (4096, 14336),
    "feed_forward.w2": (14336, 4096),
    "feed_forward.w3": (4096, 14336),
}
LAYERS = [(f"layers.{i}.{n}", k, out) for i in range(3) for n, (k, out) in SHAPES.items()]
LAYERS.append(("output", 4096, 128256))


@dataclass
class _Problem:
    """What the rules read of an :class:`~autoprec.agents.Problem`."""

    device: str = "h100-sxm"
    precisions: tuple[str, ...] = PRECISION_NAMES
    evaluator: SimpleNamespace = field(init=False)
    table: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.evaluator = SimpleNamespace(device=get_device(self.device))
        rows = [SimpleNamespace(name=n, fan_in=k, fan_out=o) for n, k, o in LAYERS]
        self.table = SimpleNamespace(rows=rows)

    def layers(self) -> list[str]:
        return [n for n, _, _ in LAYERS]

    def choices(self, layer: str) -> list[str]:
        supported = self.evaluator.device.supports
        return [p for p in self.precisions if supported(p)]


def test_each_rule_is_the_rule_people_write():
    rules = dict(hand_rule_policies(_Problem()))
    assert list(rules) == [
        "torchao-auto-tensorwise",
        "torchao-auto-rowwise",
        "fp8-except-output",
        "fp8-first-last-bf16",
    ]
    tensorwise = rules["torchao-auto-tensorwise"]  # K <= 4096 and N <= 1024 stay bf16
    assert tensorwise["layers.1.attention.wk"] == tensorwise["layers.1.attention.wv"] == "bf16"
    assert tensorwise["layers.1.attention.wq"] == tensorwise["output"] == "fp8"
    rowwise = rules["torchao-auto-rowwise"]  # N <= 2048, or N <= 4096 and K <= 2048: bf16
    assert rowwise["layers.0.attention.wk"] == "bf16"
    assert rowwise["layers.0.feed_forward.w1"] == rowwise["layers.0.attention.wq"] == "fp8_rowwise"
    no_head = rules["fp8-except-output"]
    assert no_head["output"] == "bf16" and set(no_head.values()) == {"fp8", "bf16"}
    assert sum(p == "fp8" for p in no_head.values()) == len(LAYERS) - 1
    megatron = rules["fp8-first-last-bf16"]
    for name, precision in megatron.items():
        assert precision == ("fp8" if name.startswith("layers.1.") else "bf16"), name


def test_no_rule_without_fp8():
    assert hand_rule_policies(_Problem(device="a100-80gb-sxm")) == []
    assert hand_rule_policies(_Problem(precisions=("fp32", "bf16"))) == []


def test_a_rule_that_lowers_nothing_is_left_out():
    problem = _Problem()
    problem.table.rows = [SimpleNamespace(name=n, fan_in=64, fan_out=64) for n, _, _ in LAYERS]
    names = [name for name, _ in hand_rule_policies(problem)]
    assert "torchao-auto-tensorwise" not in names and "torchao-auto-rowwise" not in names
    assert "fp8-except-output" in names
