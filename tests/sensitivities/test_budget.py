"""The choice of a sensitivity method from predicted costs, and the focused sweep's order and
interpolation (pure calculation: no model runs here)."""

from __future__ import annotations

import math

import pytest

from autoprec.sensitivities.budget import (
    FOCUSED_MIN_LAYERS,
    Costs,
    check_budget,
    check_method,
    fill,
    plan,
    priority,
    role,
    warm_up_steps,
)

COSTS = Costs(layers=50, lowered=4, pass_s=0.5)  # a layer: 2.6 s, the sweep: 130 s


@pytest.mark.parametrize(
    "left, method, measured",
    [
        (1000.0, "sweep", 50),  # the whole sweep fits
        (130.0, "sweep", 50),
        (100.0, "focused", 38),  # as many layers as fit
        (2 * COSTS.layer_s, "focused", FOCUSED_MIN_LAYERS),
        (COSTS.layer_s, "taylor", 0),  # fewer than two layers fit: the estimate
        (-5.0, "taylor", 0),  # the warm-up already spent the budget
    ],
)
def test_auto_takes_the_most_accurate_method_that_fits(left, method, measured):
    chosen = plan("auto", COSTS, left_s=left, budget_s=45.0)
    assert (chosen.method, chosen.measured) == (method, measured)
    assert chosen.predicted_s <= max(left, COSTS.taylor_s)
    assert chosen.describe().count("\n") == 0 and "45 s budget" in chosen.describe()


def test_the_prediction_scales_with_the_timed_pass():
    assert COSTS.sweep_s == pytest.approx(50 * COSTS.layer_s) == pytest.approx(130.0)
    assert Costs(50, 4, 1.0).sweep_s == pytest.approx(2 * COSTS.sweep_s)
    assert COSTS.taylor_s < COSTS.layer_s * FOCUSED_MIN_LAYERS < COSTS.sweep_s
    slow = plan("auto", Costs(50, 4, 5.0), left_s=40.0, budget_s=100.0)  # one layer fits
    assert slow.method == "taylor" and "a full sweep would take ~1300 s" in slow.describe()


def test_explicit_methods_are_taken_as_asked():
    assert plan("sweep", COSTS, left_s=1.0, budget_s=1.0).method == "sweep"
    assert plan("taylor", COSTS, left_s=1e9, budget_s=1e9).method == "taylor"
    focused = plan("focused", COSTS, left_s=0.0, budget_s=1.0)  # never fewer than two layers
    assert (focused.method, focused.measured) == ("focused", FOCUSED_MIN_LAYERS)
    assert plan("focused", COSTS, left_s=1e9, budget_s=1e9).measured == 50
    assert plan("auto", COSTS, left_s=None, budget_s=None).method == "sweep"  # no budget


def test_the_warm_up_is_cut_only_when_its_worst_case_takes_over_the_budget():
    assert warm_up_steps(30, 0.01, 40.0, attempts=4) == 30  # 1.2 s at most: as asked
    assert warm_up_steps(30, 0.4, 40.0, attempts=4) == 10  # 4 x 10 x 0.4 s = 40% of 40 s
    assert warm_up_steps(30, 100.0, 40.0, attempts=4) == 1  # never none
    assert warm_up_steps(0, 100.0, 40.0, attempts=4) == 0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "45"])
def test_a_budget_must_be_positive_seconds(bad):
    with pytest.raises(ValueError, match="positive number of seconds"):
        check_budget(bad)


def test_unknown_method_lists_the_methods():
    with pytest.raises(ValueError, match="auto, sweep, focused, taylor"):
        check_method("exact")


def block_names(blocks: int) -> list[str]:
    names = ["patch_embed.proj"]
    for b in range(blocks):
        names += [f"blocks.{b}.attn.qkv", f"blocks.{b}.attn.proj"]
        names += [f"blocks.{b}.mlp.fc1", f"blocks.{b}.mlp.fc2"]
    return [*names, "head"]


def test_roles_are_names_without_their_numbers():
    assert role("blocks.3.mlp.fc1") == role("blocks.11.mlp.fc2") == "blocks.#.mlp.fc#"
    assert role("layer2.0.downsample.0") == "layer#.#.downsample.#" and role("fc") == "fc"


@pytest.mark.parametrize("blocks", [0, 1, 3, 12])
def test_priority_takes_the_roles_in_turn_each_spread_over_the_depth(blocks):
    names = block_names(blocks)
    params = [100 if "fc" in n else 10 for n in names]
    order = priority(names, params)
    assert sorted(order) == list(range(len(names)))
    roles = len({role(n) for n in names})
    first = [role(names[i]) for i in order[:roles]]
    assert len(set(first)) == roles  # one layer of every role before a second of any
    alone = [r for r in first if sum(role(n) == r for n in names) == 1]
    assert first[: len(alone)] == alone  # the layers alone in their role first: no kin to fill
    if blocks > 1:
        assert first[len(alone)] == "blocks.#.mlp.fc#"  # then the most parameters
    fc = [i for i in order if role(names[i]) == "blocks.#.mlp.fc#"]
    if len(fc) >= 3:  # first, last, then the middle of that role
        members = sorted(fc)
        assert fc[:3] == [members[0], members[-1], members[(len(members) - 1) // 2]]


def test_fill_keeps_the_swept_rows_and_interpolates_the_rest_over_depth():
    names = ["b.0.x", "b.1.x", "b.2.x", "b.3.x", "b.4.x", "b.5.x"]
    swept = {
        0: ((0.0, 0.2), (1.0, 1.0 - 1e-2)),
        2: ((0.0, 0.4), (1.0, 1.0 - 1e-4)),
        4: ((0.0, math.inf), (1.0, 0.0)),  # diverged on its own: left out of the interpolation
    }
    rows = fill(swept, names)
    assert rows[0] == swept[0] and rows[2] == swept[2] and rows[4] == swept[4]
    changes, cosines = rows[1]
    assert changes[1] == pytest.approx(0.3)  # loss changes: linear
    assert 1.0 - cosines[1] == pytest.approx(1e-3)  # gradient distances: geometric
    assert 1.0 - cosines[0] == pytest.approx(1e-16)  # fp32 (distance 0): at the log floor
    assert rows[3][0][1] == pytest.approx(0.4)  # the finite neighbour
    assert rows[5][1][1] == 0.0  # after the last swept layer: its values
    with pytest.raises(ValueError, match="at least one"):
        fill({}, names)


def test_fill_interpolates_within_a_role():
    names = ["b.0.attn", "b.0.mlp", "b.1.attn", "b.1.mlp", "head"]
    swept = {i: ((float(i),), (1.0 - 10.0**-i,)) for i in (0, 1, 3)}  # attn 0; mlp 1 and 3
    rows = fill(swept, names)
    assert rows[2] == swept[0]  # b.1.attn: from b.0.attn only, not from the mlp layers
    assert rows[4][0] == (3.0,)  # head, a role never swept: from every swept layer
