"""nvfp4 and fp8_block graded by both methods: the sweep runs them through the runtime's emulated
modules, the Taylor estimate rounds like their blocks; both order them as their formats do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sensitivity_helpers import Data, Spec
from torch import nn

from autoprec.precision import Precision
from autoprec.sensitivities import sensitivity
from autoprec.sensitivities.measure import round_like_runtime


class Data128(Data):
    """test_sensitivity's stand-in for a DataBundle, 128 features wide (whole fp8_block tiles)."""

    key = "test-data-128"

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 128, generator=g)
        self.y = self.x[:, :16].argmax(1)


@pytest.mark.parametrize("method", ["sweep", "taylor"])
def test_block_formats_are_graded_and_ordered_by_their_bits(method):
    torch.manual_seed(0)
    spec = Spec(nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128)))
    formats = ["fp32", "bf16", "fp8_block", "nvfp4"]
    options = {"batches": 4, "batch_size": 32, "method": method, "cache": False}
    table = sensitivity(spec, Data128(), formats, train_steps=5, **options)
    d = np.abs(np.array(table.matrix()))
    assert table.precisions == tuple(formats) and np.all(d[:, 0] == 0)
    for row in d:  # bf16 (8 significant bits) < e4m3 in 1x128 tiles < e2m1 in blocks of 16
        assert row[1] < row[2] < row[3]


def test_the_estimate_rounds_like_the_blocks():
    t = torch.randn(8, 256)
    for p in (Precision.NVFP4, Precision.FP8_BLOCK):
        r = round_like_runtime(t, p, "forward")
        assert r.shape == t.shape and not torch.equal(r, t)
    assert len(torch.unique(round_like_runtime(t, Precision.NVFP4, "forward")[0, :16].abs())) <= 8
    bias = torch.randn(32)  # 1-D: left as is (the kernels leave biases unrounded)
    assert torch.equal(round_like_runtime(bias, Precision.FP8_BLOCK, "forward"), bias)
    narrow = torch.randn(4, 100)  # a partial tile, zero-padded as the emulation pads it
    padded = torch.nn.functional.pad(narrow, (0, 28))
    want = round_like_runtime(padded, Precision.FP8_BLOCK, "forward")[:, :100]
    assert torch.equal(round_like_runtime(narrow, Precision.FP8_BLOCK, "forward"), want)
    assert torch.equal(round_like_runtime(narrow, Precision.NVFP4, "forward"), narrow)
