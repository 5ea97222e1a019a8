"""Helpers for the sensitivity tests: a model spec and a fixed stand-in for a DataBundle."""

from __future__ import annotations

import torch
from torch import nn


class Spec:
    def __init__(self, module: nn.Module) -> None:
        self.name, self.module = "mlp", module

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)


class Data:
    """A fixed, learnable stand-in for a DataBundle."""

    key = "test-data"

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 1, 8, 8, generator=g)
        self.y = (self.x.flatten(1)[:, :10].argmax(1)).long()

    def loader(self, split="train", batch_size=32, shuffle=True, seed=0):
        return [
            (self.x[i : i + batch_size], self.y[i : i + batch_size])
            for i in range(0, 256, batch_size)
        ]

    def fixed_batches(self, n, batch_size, split="train", seed=0):
        return self.loader(split, batch_size)[:n]
