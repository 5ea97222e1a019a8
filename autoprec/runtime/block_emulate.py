"""Emulate mode's ``nvfp4`` and ``fp8_block`` on ``nn.Linear``: the swapped modules that run
their three GEMMs through autoprec's kernels.

Like mxfp8 (:class:`~.float8_emulate.EmulatedMXLinear`), each cast of these formats depends on
the GEMM an operand enters (its blocks lie along that GEMM's reduction dimension), so a layer
runs as a module sharing the original's parameters:

- :class:`EmulatedNVFP4Linear`: :func:`autoprec.kernels.nvfp4_linear`, Transformer Engine's
  ``NVFP4BlockScaling`` recipe (E2M1 in 1x16 blocks with E4M3 scales and an fp32 scale per
  tensor; the weight in 16x16 tiles; the output gradient stochastically rounded; a random
  Hadamard transform on both weight-gradient operands). Each layer owns a ``torch.Generator``
  for its stochastic rounding and its 16 Hadamard signs, both seeded from the layer's name and
  the run's seed (:func:`layer_seed`; the run's seed is ``torch.initial_seed()`` when the
  policy is applied, which a seeded run sets), so a run repeats bit for bit and two layers
  draw independently, as torchao's ``NVFP4Linear`` draws its own signs per layer (TE uses one
  fixed vector for all).
- :class:`EmulatedBlockFP8Linear`: :func:`autoprec.kernels.block_fp8_linear`, torchao's
  ``fp8_blockwise_mm`` (1x128 e4m3 tiles for activations and gradients, 128x128 blocks for the
  weight, fp32 scales).

Both read their input and weight in :func:`~autoprec.precision.block_io_format`'s format (bf16:
TE trains under bf16 autocast, torchtitan hands torchao's modules bf16 parameters) and hand
their output on in the input's dtype; the bias is added in bf16 by the kernel.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from autoprec.kernels import get_format
from autoprec.precision import Precision, block_io_format
from autoprec.runtime.float8_emulate import MXCasts, share_linear

if TYPE_CHECKING:
    from autoprec.kernels import NVFP4Options

__all__ = ["EmulatedBlockFP8Linear", "EmulatedNVFP4Linear", "layer_seed", "rht_signs"]


def layer_seed(name: str, seed: int, stream: str) -> int:
    """A 63-bit seed for ``stream`` (``"sr"``, ``"rht"``) of layer ``name`` in a run seeded
    ``seed``: a hash, the same in every process (Python's ``hash`` of a string is not)."""
    digest = hashlib.blake2b(f"{seed}\0{stream}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rht_signs(name: str, seed: int) -> tuple[int, ...]:
    """Layer ``name``'s 16 random Hadamard signs (each 1 or -1) in a run seeded ``seed``."""
    generator = torch.Generator().manual_seed(layer_seed(name, seed, "rht"))
    bits = torch.randint(0, 2, (16,), generator=generator)
    return tuple(int(b) * 2 - 1 for b in bits)


def _run(kernel, module: nn.Linear, input: Tensor, **kwargs) -> Tensor:  # noqa: A002
    casts = module.casts
    dtype = get_format(block_io_format(casts.precision, casts.output_format)).torch_dtype
    bias = None if module.bias is None else module.bias.to(dtype)
    out = kernel(input.to(dtype), module.weight.to(dtype), bias, **kwargs)
    return out.to(input.dtype)


class EmulatedNVFP4Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run TE's NVFP4 recipe in emulation (built by
    :meth:`from_linear`, sharing the original's parameters)."""

    casts: MXCasts
    options: NVFP4Options
    generator: torch.Generator

    @classmethod
    def from_linear(
        cls,
        module: nn.Linear,
        name: str,
        region: str | None = None,
        seed: int | None = None,
        options: NVFP4Options | None = None,
    ) -> EmulatedNVFP4Linear:
        """A module running ``module``'s very parameters in nvfp4.

        Args:
            module: the Linear.
            name: the layer's name (seeds its generator and signs).
            region: the policy's autocast region format (None: none).
            seed: the run's seed; None: ``torch.initial_seed()``.
            options: :class:`autoprec.kernels.NVFP4Options` (TE's defaults if None); signs it
                leaves unset are the layer's own (:func:`rht_signs`).
        """
        from autoprec.kernels import NVFP4Options

        seed = torch.initial_seed() if seed is None else seed
        options = options or NVFP4Options()
        if options.rht_signs is None:
            options = dataclasses.replace(options, rht_signs=rht_signs(name, seed))
        new = share_linear(cls, module, MXCasts(Precision.NVFP4, output_format=region))
        new.options = options
        new.generator = torch.Generator(device=module.weight.device)
        new.generator.manual_seed(layer_seed(name, seed, "sr"))
        return new

    def forward(self, input: Tensor) -> Tensor:  # noqa: D102
        from autoprec.kernels import nvfp4_linear

        return _run(nvfp4_linear, self, input, options=self.options, generator=self.generator)


class EmulatedBlockFP8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run fp8 block scaling in emulation (built by
    :meth:`from_linear`, sharing the original's parameters)."""

    casts: MXCasts

    @classmethod
    def from_linear(cls, module: nn.Linear, region: str | None = None) -> EmulatedBlockFP8Linear:
        """A module running ``module``'s very parameters in fp8_block, inside an autocast
        region of format ``region`` (None: none)."""
        return share_linear(cls, module, MXCasts(Precision.FP8_BLOCK, output_format=region))

    def forward(self, input: Tensor) -> Tensor:  # noqa: D102
        from autoprec.kernels import block_fp8_linear

        return _run(block_fp8_linear, self, input)
