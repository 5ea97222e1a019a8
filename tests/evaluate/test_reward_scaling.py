"""The reward's accuracy weight from Chinchilla's loss fit (a loss increase priced as the extra
training it costs)."""

from __future__ import annotations

import math

import pytest

from autoprec.evaluate.reward import (
    CHINCHILLA,
    chinchilla_accuracy_weight,
    chinchilla_tokens,
)


def chinchilla_loss(params: float, tokens: float) -> float:
    c = CHINCHILLA
    return c["E"] + c["A"] / params ** c["alpha"] + c["B"] / tokens ** c["beta"]


@pytest.mark.parametrize(("params", "tokens"), [(8e9, 15e12), (7e10, 1e12), (1e9, 2e10)])
def test_the_weight_prices_a_loss_increase_as_the_tokens_that_recover_it(params, tokens):
    # A run `delta` above its loss needs k = exp(w * delta) times the tokens to catch up: check
    # it against Chinchilla's own loss at k * D, by a finite difference, not the formula.
    weight = chinchilla_accuracy_weight(params, tokens)
    delta = 1e-4
    extra = math.exp(weight * delta)
    loss = chinchilla_loss(params, tokens)
    recovered = (loss - chinchilla_loss(params, tokens * extra)) / loss
    assert recovered == pytest.approx(delta, rel=1e-2)  # exact to first order in delta


def test_longer_runs_price_loss_higher_and_the_inverse_recovers_the_length():
    weights = [chinchilla_accuracy_weight(8e9, d) for d in (1e10, 1e11, 1e12, 15e12)]
    assert weights == sorted(weights) and weights[0] > 1 / CHINCHILLA["beta"]
    assert round(weights[-1], 1) == 82.9  # Llama 3 8B on its 15T tokens
    for tokens in (1e10, 3e11, 15e12):
        weight = chinchilla_accuracy_weight(8e9, tokens)
        assert chinchilla_tokens(8e9, weight) == pytest.approx(tokens, rel=1e-9)
    assert chinchilla_tokens(8e9, 1 / CHINCHILLA["beta"]) == 0.0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_sizes_are_one_line_errors(bad):
    with pytest.raises(ValueError, match="positive finite"):
        chinchilla_accuracy_weight(bad, 1e12)
    with pytest.raises(ValueError, match="positive finite"):
        chinchilla_tokens(8e9, bad)
