"""The surrogate prices every format a search offers (issue 36): its sensitivity table grades
the problem's precisions (before, the block formats had no column, so the surrogate priced their
loss at 0 and PPO proposed all-nvfp4 whatever the reward); a pair the runtime cannot run is not
graded; an fp8 recipe reads as tensorwise fp8."""

from __future__ import annotations

import math

import pytest

from autoprec.agents import Problem
from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.evaluate.surrogate import Surrogate
from autoprec.sensitivities.grade import SensitivityTable, sensitivity

SMALL = {"steps": 4, "warm_start_steps": 10}


def _table() -> SensitivityTable:
    precisions = ("fp32", "fp8", "nvfp4")
    nan = math.nan
    loss = ((0.0, 0.01, 0.03), (0.0, 0.02, nan))  # "b" cannot run nvfp4: (nan, nan)
    cosine = ((1.0, 0.99, 0.97), (1.0, 0.98, nan))
    return SensitivityTable(
        "sweep", "toy", "fp", "data", ("a", "b"), precisions, loss, cosine, 1.0, 0.0, {}
    )


def test_a_pair_the_runtime_cannot_run_has_no_entry_and_no_prior():
    table = _table()
    assert table.entry("b", "nvfp4") is None and table.entry("a", "nvfp4").loss_delta == 0.03
    s = Surrogate(table)
    assert s.predict({"a": "nvfp4", "b": "nvfp4"}) == pytest.approx(0.03)  # b's nan counts 0
    assert math.isfinite(s.predict({"b": "nvfp4"}))


def test_an_fp8_recipe_the_table_did_not_grade_reads_as_tensorwise_fp8():
    s = Surrogate(_table())
    for recipe in ("fp8_rowwise", "fp8_rowwise_gw_hp"):
        assert s.predict({"a": recipe, "b": "fp8"}) == s.predict({"a": "fp8", "b": "fp8"}) > 0


def test_the_sweep_grades_the_linear_layers_and_skips_the_convolutions(spec, data):
    table = sensitivity(
        spec, data, ("fp32", "fp8_block"), batches=1, batch_size=8, train_steps=0, cache=False
    )
    assert [table.entry(n, "fp8_block") is None for n in table.layers] == [
        True, True, False, False,
    ]  # fmt: skip  # conv1, conv2: the runtime runs fp8_block on nn.Linear only
    assert all(math.isfinite(table.entry(n, "fp8_block").loss_delta) for n in ("fc1", "fc2"))


def test_a_problem_has_its_evaluator_grade_the_formats_it_offers(spec, data):
    ev = Evaluator(spec, data, "b200", config=EvaluatorConfig(**SMALL))
    assert ev.surrogate_formats is None  # the default formats until a problem says otherwise
    Problem(ev, precisions=("bf16", "fp8_rowwise", "nvfp4"))
    assert ev.surrogate_formats == ("fp32", "bf16", "fp8", "nvfp4")
    surrogate = ev.surrogate()
    assert [p.value for p in surrogate.precisions] == ["bf16", "fp8", "nvfp4"]
    # nvfp4 has a price now (fc1 runs it; fc2's 10 outputs are not a multiple of 16)
    assert surrogate.table.entry("fc1", "nvfp4") is not None
    assert surrogate.table.entry("fc2", "nvfp4") is None
    assert surrogate.predict({"fc1": "nvfp4"}) != 0.0
    Problem(ev, precisions=("bf16", "mxfp8"))  # built once: a later problem changes nothing
    assert ev.surrogate_formats == ("fp32", "bf16", "fp8", "nvfp4")


def _column(changes: list[float], measured: list[bool]) -> SensitivityTable:
    layers = tuple(f"l{i}" for i in range(len(changes)))
    loss = tuple((0.0, c) for c in changes)
    cosine = tuple((1.0, 1.0 - abs(c)) for c in changes)
    return SensitivityTable(
        "focused", "toy", "fp", "data", layers, ("fp32", "nvfp4"), loss, cosine, 1.0, 0.0, {},
        measured=tuple(measured),
    )  # fmt: skip


def test_a_measured_layer_that_stands_out_of_its_column_starts_with_its_own_term():
    blocks = [0.0003, 0.0002, 0.0004, 0.0003, 0.0002, 0.0003, 0.0004, 0.0003] * 4
    changes = [*blocks, 0.005]  # 32 blocks' layers and a head, as llama-small's table has it
    n = len(changes)
    s = Surrogate(_column(changes, [True] * n))
    everything = {f"l{i}": "nvfp4" for i in range(n)}
    assert s.predict(everything) == pytest.approx(sum(changes))  # the uniform: unchanged
    # the head at nvfp4 costs about its own measured change, not 1/33 of the sum
    head = s.predict({f"l{n - 1}": "nvfp4"})
    assert head == pytest.approx(0.005, rel=0.1) and head > 5 * s.predict({"l0": "nvfp4"})
    # an interpolated row is not trusted layer by layer: the sum is spread evenly again
    spread = Surrogate(_column(changes, [True] * (n - 1) + [False]))
    assert spread.predict({f"l{n - 1}": "nvfp4"}) == pytest.approx(sum(changes) / n)
    # no layer stands out: no own term (the resnet18 finding: deviations are noise there)
    even = Surrogate(_column(blocks, [True] * len(blocks)))
    assert even.predict({"l2": "nvfp4"}) == pytest.approx(sum(blocks) / len(blocks))
