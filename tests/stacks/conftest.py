"""Shared by the stack tests: a tiny zoo llama (the zoo's names, widths multiples of 16, so that
torchao's float8 recipes run on this CPU), its batches, and a few SGD steps of it."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoprec.layers import tunable_layers
from autoprec.models.llama import Llama, LlamaConfig

pytest.importorskip("torchao")

TINY = LlamaConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128, seq_len=16
)
STEPS = 3


class Tiny:
    """The tiny llama, its batches and its training loop."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Llama(TINY)
        gen = torch.Generator().manual_seed(1)
        self.batches = [
            torch.randint(0, TINY.vocab_size, (4, TINY.seq_len + 1), generator=gen)
            for _ in range(STEPS)
        ]

    def names(self) -> list[str]:
        return [n for n, _ in tunable_layers(self.model)]

    def copy(self) -> nn.Module:
        return copy.deepcopy(self.model)

    def train(
        self, model: nn.Module, context: Callable[[], contextlib.AbstractContextManager]
    ) -> list[float]:
        """``STEPS`` SGD steps (lr 0.1), the forward in ``context()``; the losses."""
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for batch in self.batches:
            x, y = batch[:, :-1], batch[:, 1:]
            optimizer.zero_grad()
            with context():
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses


@pytest.fixture
def tiny() -> Tiny:
    return Tiny()
