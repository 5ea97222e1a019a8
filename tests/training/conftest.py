"""Fixtures of the training tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autoprec.training.recipe import TrainingRecipe


@pytest.fixture
def optimizers_made(monkeypatch) -> list[tuple[str, str, float]]:
    """Every optimizer a recipe makes while the test runs, as ``(package/module that asked,
    optimizer class, rate)``: ``("training/pretrain", "AdamW", 3e-4)`` is the warm start's."""
    made: list[tuple[str, str, float]] = []
    real = TrainingRecipe.make_optimizer

    def spy(self, params, lr=None):
        opt = real(self, params, lr)
        caller = Path(sys._getframe(1).f_code.co_filename)
        made.append((f"{caller.parent.name}/{caller.stem}", type(opt).__name__, opt.defaults["lr"]))
        return opt

    monkeypatch.setattr(TrainingRecipe, "make_optimizer", spy)
    return made
