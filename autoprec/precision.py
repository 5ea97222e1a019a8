"""The precisions a layer can train in, and the number formats each one means.

A layer's *precision* names what its matrix work uses; master weights always stay fp32.

| precision | forward operands | backward (output gradient) | scaled |
|-----------|------------------|----------------------------|--------|
| fp32      | fp32             | fp32                       | no     |
| tf32      | tf32             | tf32                       | no     |
| bf16      | bf16             | bf16                       | no     |
| fp16      | fp16             | fp16                       | no (loss scaling guards it) |
| fp8       | fp8_e4m3         | fp8_e5m2                   | yes, per tensor (current)  |
| fp8_rowwise | fp8_e4m3       | fp8_e4m3                   | yes, per row, powers of two |
| fp8_rowwise_gw_hp | fp8_e4m3 | fp8_e4m3 (input gradient); weight gradient unrounded | yes |
| mxfp8     | fp8_e4m3, 1x32 blocks | fp8_e4m3, 1x32 blocks  | yes, E8M0 per block (Blackwell) |
| fp8_block | fp8_e4m3, 1x128 / 128x128 | fp8_e4m3, 1x128 tiles | yes, fp32 per tile (Hopper) |
| nvfp4     | fp4_e2m1, 1x16 / 16x16 | fp4_e2m1, 1x16, stochastic | yes, E4M3 per 16 (Blackwell) |

The fp8 precisions are torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``):
``fp8`` is ``tensorwise`` (each operand scaled from its own current amax), ``fp8_rowwise`` is
``rowwise`` and ``fp8_rowwise_gw_hp`` is ``rowwise_with_gw_hp``. :data:`FLOAT8_RECIPES` spells
out, per recipe, how each operand of each of a Linear's three GEMMs is cast; torchao's
``Float8Linear`` runs it natively and the emulate mode reproduces it. The recipes differ in
software, not in hardware: all of them run on the fp8 tensor cores (:attr:`Precision.hardware`).

``mxfp8`` is OCP MXFP8 as torchao's MXFP8 training runs it (``torchao.prototype.moe_training``
``MXFP8Linear``, RCEIL scales): every operand of all three GEMMs in e4m3 blocks of 32 along
that GEMM's reduction dimension, each with a power-of-two (E8M0) scale, on tensor cores that
read block scales (Blackwell: hardware ``mxfp8``).

``fp8_block`` is DeepSeek-V3's fp8 block scaling as torchao's ``blockwise_fp8_training``
prototype (``Float8BlockwiseLinear``) and Transformer Engine's ``Float8BlockScaling`` run it:
activations and gradients in e4m3 tiles of 1x128 along the GEMM's reduction dimension, weights
in 128x128 e4m3 blocks, one fp32 scale per tile or block. It runs on the fp8 tensor cores
(hardware ``fp8``: Hopper and Blackwell).

``nvfp4`` is Transformer Engine's ``NVFP4BlockScaling`` recipe with its defaults: all three GEMMs
in E2M1 with one E4M3 scale per 16 values along the reduction dimension and one fp32 scale per
tensor; the weight in 16x16 2-D blocks, the output gradient stochastically rounded, a random
Hadamard transform on both operands of the weight-gradient GEMM (hardware ``nvfp4``:
Blackwell). No per-GEMM role split of it is a precision here: neither backend runs one that
keeps only the weight gradient in high precision (TE's recipe switches the 2-D weight blocks,
the stochastic rounding and the transform, and its ``backward_override="high_precision"``
leaves *both* backward GEMMs unquantised; torchao's ``NVFP4TrainingConfig`` quantises all
three GEMMs and has no per-GEMM option).

Both block formats, like ``mxfp8``, run a Linear as a swapped module (:attr:`Precision.swapped`)
reading its operands in :func:`block_io_format`'s format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType


@dataclass(frozen=True)
class FormatFacts:
    """The bit layout and storage of a number format: what needs no torch to know.

    :class:`autoprec.kernels.Format` adds the torch dtype and the derived numeric limits; the
    cost model, the environment and the plots read these facts directly.

    Args:
        name: registry name (``"bf16"``).
        exponent_bits: width of the exponent field.
        mantissa_bits: width of the stored mantissa (fraction) field.
        bias: exponent bias.
        storage_bytes: bytes one value occupies in memory (TF32 lives in a 32-bit container;
            a 4-bit format packs two values a byte: 0.5).
        has_inf: whether the format encodes infinities. Formats without (OCP ``e4m3fn``) keep
            only the all-ones pattern for NaN, so their top binade has one value fewer, unless
            they have no NaN either (``has_nan``).
        overflow: what round-to-nearest does with a magnitude past the largest finite value:
            ``"inf"`` (IEEE formats), ``"saturate"`` (clamp to ``±max_finite``, infinities
            included: torch's cast to ``float8_e4m3fn`` and NVIDIA's ``cvt.rn.satfinite`` do
            this) or ``"nan"`` (the OCP non-saturating mode for formats without inf).
        has_nan: whether the format encodes NaN. OCP's sub-byte MX elements (``fp4_e2m1``)
            encode none: every bit pattern is a number, the top binade full.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    storage_bytes: float
    has_inf: bool = True
    overflow: str = "inf"
    has_nan: bool = True

    @property
    def bits(self) -> int:
        """Number of significant bits in the encoding (sign + exponent + mantissa)."""
        return 1 + self.exponent_bits + self.mantissa_bits


#: Every format autoprec emulates, in registry order: the one table of bits and bytes.
FORMAT_FACTS: Mapping[str, FormatFacts] = MappingProxyType(
    {
        f.name: f
        for f in (
            FormatFacts("fp32", 8, 23, 127, 4),
            # TF32 as NVIDIA tensor cores read it: fp32's range, 10 mantissa bits, 32-bit storage.
            FormatFacts("tf32", 8, 10, 127, 4),
            FormatFacts("bf16", 8, 7, 127, 2),
            FormatFacts("fp16", 5, 10, 15, 2),
            FormatFacts("fp8_e4m3", 4, 3, 7, 1, has_inf=False, overflow="saturate"),
            FormatFacts("fp8_e5m2", 5, 2, 15, 1),
            # OCP E2M1, NVFP4's element: no inf, no NaN, largest value 6; two values a byte.
            FormatFacts(
                "fp4_e2m1", 2, 1, 1, 0.5, has_inf=False, overflow="saturate", has_nan=False
            ),
        )
    }
)


#: The formats tensor cores compute in, as the device database names them (widest first).
HARDWARE_PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4")
#: MXFP8's block: elements per E8M0 scale, along the GEMM's reduction dimension.
MX_BLOCK = 32
#: NVFP4's block: elements per E4M3 scale along the reduction dimension (the weight: 16x16).
NVFP4_BLOCK = 16
#: fp8 block scaling's tile: 1x128 for activations and gradients, 128x128 for weights.
FP8_BLOCK_TILE = 128


def mx_io_format(region: str | None) -> str:
    """The format an ``mxfp8`` layer reads its input and weight in and writes its output in,
    inside an autocast region of format ``region`` (None: no region): bf16 in a bf16 region,
    as torchtitan trains torchao's ``MXFP8Linear`` (FSDP2 hands it bf16 parameters; it
    multiplies its operands in the dtype they come in), else fp32 (its master weight's; in an
    fp16 region too: torchao's MX casts take fp32 or bf16)."""
    return "bf16" if region == "bf16" else "fp32"


def block_io_format(precision: Precision, region: str | None) -> str:
    """The format a swapped block-scaled Linear (``mxfp8``, ``fp8_block``, ``nvfp4``) reads its
    input and weight in and writes its output in, inside an autocast region of format
    ``region`` (None: no region): :func:`mx_io_format`'s for ``mxfp8``; bf16 for ``fp8_block``
    and ``nvfp4`` in any region, as their backends run them (TE trains under bf16 autocast;
    torchao's ``Float8BlockwiseLinear`` writes bf16).

    Raises:
        ValueError: ``precision`` is not block-scaled.
    """
    if not precision.is_block:
        raise ValueError(
            f"{precision.value} is not block-scaled; expected mxfp8, fp8_block or nvfp4"
        )
    return mx_io_format(region) if precision.is_mx else "bf16"


@dataclass(frozen=True)
class OperandCast:
    """How one operand of one GEMM is cast: to ``fmt`` (None: kept in high precision) with one
    scale per tensor (``axis`` None) or one per slice along the other axis, the amax reduced
    over ``axis`` of the operand as stored: the input ``(M, K)``, the weight ``(N, K)``, the
    output gradient ``(M, N)`` (M: tokens, K: input features, N: output features)."""

    fmt: str | None
    axis: int | None = None


_HP = OperandCast(None)


#: The operands of a Linear's three GEMMs, in the order of :class:`Float8Recipe`'s pairs.
GEMM_OPERANDS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "output": ("input", "weight"),
        "grad_input": ("grad_output", "weight"),
        "grad_weight": ("grad_output", "input"),
    }
)


@dataclass(frozen=True)
class Float8Recipe:
    """torchao's casts of a ``Float8Linear``'s three GEMMs under one recipe.

    Attributes:
        name: torchao's recipe name (``Float8LinearRecipeName``).
        output: (input, weight) of ``output = input @ weight.T``.
        grad_input: (output gradient, weight) of ``grad_input = grad_output @ weight``.
        grad_weight: (output gradient, input) of ``grad_weight = grad_output.T @ input``.
        power_of_two: scales rounded down to powers of two (``round_scales_to_power_of_2``).
    """

    name: str
    output: tuple[OperandCast, OperandCast]
    grad_input: tuple[OperandCast, OperandCast]
    grad_weight: tuple[OperandCast, OperandCast]
    power_of_two: bool

    def gemms(self) -> dict[str, tuple[OperandCast, OperandCast]]:
        """``{"output" | "grad_input" | "grad_weight": (operand casts)}``."""
        return {
            "output": self.output,
            "grad_input": self.grad_input,
            "grad_weight": self.grad_weight,
        }

    def low(self, gemm: str) -> bool:
        """Whether ``gemm`` runs in fp8 (torchao: both operands or neither)."""
        return self.gemms()[gemm][0].fmt is not None


_E4M3, _E5M2, _E2M1 = "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"


class Precision(str, Enum):
    """A layer precision; compares equal to its string value (``Precision.BF16 == "bf16"``)."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP8_ROWWISE = "fp8_rowwise"
    FP8_ROWWISE_GW_HP = "fp8_rowwise_gw_hp"
    MXFP8 = "mxfp8"
    FP8_BLOCK = "fp8_block"
    NVFP4 = "nvfp4"

    def __str__(self) -> str:
        return self.value

    @property
    def forward_format(self) -> str:
        """Format of the layer's operands (input and weight) in forward."""
        if self is Precision.NVFP4:
            return _E2M1
        return _E4M3 if self.is_fp8 or self.is_block else self.value

    @property
    def backward_format(self) -> str:
        """Format of the gradient with respect to the layer's output in backward (for the input
        gradient's GEMM, where a recipe casts it differently per GEMM)."""
        if self.is_fp8:
            return self.recipe.grad_input[0].fmt or _E4M3
        return self.forward_format

    @property
    def swapped(self) -> bool:
        """Whether a Linear at this precision runs as a swapped module (a torchao fp8 recipe's
        ``Float8Linear``, ``MXFP8Linear``, ``Float8BlockwiseLinear``, an NVFP4 Linear, or their
        emulations) rather than under autocast. (This was ``is_8bit`` before ``nvfp4``.)"""
        return self.is_fp8 or self.is_block

    @property
    def is_block(self) -> bool:
        """Whether this is block-scaled: one scale per block of elements along the GEMM's
        reduction dimension (``mxfp8``, ``fp8_block``, ``nvfp4``)."""
        return self in (Precision.MXFP8, Precision.FP8_BLOCK, Precision.NVFP4)

    @property
    def block_size(self) -> int | None:
        """Elements per scale along the reduction dimension (mxfp8 32, fp8_block 128, nvfp4
        16), None for the formats without blocks."""
        return _BLOCK_SIZES.get(self)

    @property
    def is_mx(self) -> bool:
        """Whether this is a block-scaled MX format (``mxfp8``)."""
        return self is Precision.MXFP8

    @property
    def is_fp8(self) -> bool:
        """Whether this is one of torchao's float8 training recipes (:data:`FLOAT8_RECIPES`;
        not ``fp8_block``, a block-scaled format)."""
        return self in FLOAT8_RECIPES

    @property
    def recipe(self) -> Float8Recipe:
        """The float8 recipe of an fp8 precision.

        Raises:
            ValueError: not an fp8 precision.
        """
        if not self.is_fp8:
            raise ValueError(f"{self.value} is not an fp8 recipe; expected one of {FP8_NAMES}")
        return FLOAT8_RECIPES[self]

    @property
    def hardware(self) -> str:
        """The tensor-core format this precision computes in (one of
        :data:`HARDWARE_PRECISIONS`): every fp8 recipe and ``fp8_block`` is ``"fp8"``."""
        return "fp8" if self.is_fp8 or self is Precision.FP8_BLOCK else self.value

    @property
    def bits(self) -> int:
        """Significant bits of the forward format (fp32 32, tf32 19, bf16 and fp16 16, fp8 8,
        nvfp4 4)."""
        return FORMAT_FACTS[self.forward_format].bits

    @property
    def bytes_ratio(self) -> float:
        """Bytes per element at the forward format, relative to fp32's 4 (tf32: 1.0; nvfp4:
        0.125, its block scales not counted)."""
        return FORMAT_FACTS[self.forward_format].storage_bytes / 4

    @property
    def scaled(self) -> bool:
        """Whether casts are scaled (from the current amax, as torchao's), per tensor, row or
        block."""
        return self.is_fp8 or self.is_block

    @property
    def width(self) -> int:
        """Rank from narrowest (0) to widest; wider formats are safer and slower."""
        return _ORDER.index(self)

    @property
    def run_with(self) -> tuple[str, str]:
        """``(backend, recipe)`` production training runs this precision with, as an exported
        policy file states it per layer (``("transformer_engine", "NVFP4BlockScaling")``)."""
        return RUN_WITH[self]

    def wider(self) -> Precision | None:
        """The next wider format (any fp8 recipe, fp8_block or mxfp8 -> fp16 -> bf16 -> tf32 ->
        fp32; nvfp4 -> bf16), None for fp32.

        fp16 widens to bf16 for its range (the usual fix for fp16 overflow), bf16 to tf32 for
        its mantissa. The fp8 recipes, fp8_block and mxfp8 share one format (e4m3), so none is
        wider than another: each widens to fp16, although :attr:`width` ranks them (tensorwise,
        rowwise, 1x128 tiles, rowwise with a high-precision weight gradient, blocks of 32: the
        more precise, the wider). nvfp4 widens to bf16, what its users do with a layer NVFP4
        hurts (the NVFP4 paper, arXiv 2509.25149, switches to bf16; torchtitan and
        Megatron-Bridge keep their bf16 tail), not to an fp8 format.
        """
        if self is Precision.NVFP4:
            return Precision.BF16
        if self.is_fp8 or self.is_block:
            return Precision.FP16
        i = self.width
        return _ORDER[i + 1] if i + 1 < len(_ORDER) else None


_ORDER = [
    Precision.NVFP4,
    Precision.FP8,
    Precision.FP8_ROWWISE,
    Precision.FP8_BLOCK,
    Precision.FP8_ROWWISE_GW_HP,
    Precision.MXFP8,
    Precision.FP16,
    Precision.BF16,
    Precision.TF32,
    Precision.FP32,
]

_BLOCK_SIZES = {
    Precision.MXFP8: MX_BLOCK,
    Precision.FP8_BLOCK: FP8_BLOCK_TILE,
    Precision.NVFP4: NVFP4_BLOCK,
}

PRECISION_NAMES = tuple(p.value for p in Precision)

#: torchao's recipes, operand by operand (``torchao.float8.config.Float8LinearConfig
#: .from_recipe_name``): tensorwise keeps one scale per tensor and e5m2 gradients; rowwise
#: scales each operand along the GEMM's reduction dimension (so the same tensor is cast twice,
#: along different axes, for its two GEMMs), e4m3 throughout, power-of-two scales; rowwise with
#: a high-precision weight gradient casts the weight per tensor for the input gradient and
#: leaves the weight gradient's GEMM unrounded.
FLOAT8_RECIPES: Mapping[Precision, Float8Recipe] = MappingProxyType(
    {
        Precision.FP8: Float8Recipe(
            "tensorwise",
            output=(OperandCast(_E4M3), OperandCast(_E4M3)),
            grad_input=(OperandCast(_E5M2), OperandCast(_E4M3)),
            grad_weight=(OperandCast(_E5M2), OperandCast(_E4M3)),
            power_of_two=False,
        ),
        Precision.FP8_ROWWISE: Float8Recipe(
            "rowwise",
            output=(OperandCast(_E4M3, 1), OperandCast(_E4M3, 1)),
            grad_input=(OperandCast(_E4M3, 1), OperandCast(_E4M3, 0)),
            grad_weight=(OperandCast(_E4M3, 0), OperandCast(_E4M3, 0)),
            power_of_two=True,
        ),
        Precision.FP8_ROWWISE_GW_HP: Float8Recipe(
            "rowwise_with_gw_hp",
            output=(OperandCast(_E4M3, 1), OperandCast(_E4M3, 1)),
            grad_input=(OperandCast(_E4M3, 1), OperandCast(_E4M3)),
            grad_weight=(_HP, _HP),
            power_of_two=True,
        ),
    }
)


#: What production training runs each precision with: ``(backend, recipe or module)``. The
#: runnability table (:mod:`autoprec.hardware.runnability`) says on which targets and shapes.
RUN_WITH: Mapping[Precision, tuple[str, str]] = MappingProxyType(
    {
        Precision.FP32: ("torch", "fp32 (TF32 off)"),
        Precision.TF32: ("torch", "tf32 (fp32_precision tf32)"),
        Precision.BF16: ("torch.autocast", "bf16"),
        Precision.FP16: ("torch.autocast", "fp16 (with loss scaling)"),
        Precision.FP8: ("torchao", "Float8LinearConfig tensorwise"),
        Precision.FP8_ROWWISE: ("torchao", "Float8LinearConfig rowwise"),
        Precision.FP8_ROWWISE_GW_HP: ("torchao", "Float8LinearConfig rowwise_with_gw_hp"),
        Precision.MXFP8: ("torchao", "MXFP8Linear (RCEIL scales)"),
        Precision.FP8_BLOCK: ("torchao", "Float8BlockwiseLinear"),
        Precision.NVFP4: ("transformer_engine", "NVFP4BlockScaling"),
    }
)

#: torchao's float8 training recipes (:data:`FLOAT8_RECIPES`), by precision name.
FP8_NAMES = tuple(p.value for p in FLOAT8_RECIPES)


def parse_precision(value: object) -> Precision:
    """Turn ``"bf16"`` (or a Precision) into a Precision.

    Raises:
        ValueError: not a known precision; the message lists the valid ones.
    """
    if isinstance(value, Precision):
        return value
    if isinstance(value, str):
        try:
            return Precision(value.strip().lower())
        except ValueError:
            pass
    raise ValueError(f"unknown precision {value!r}; expected one of {', '.join(PRECISION_NAMES)}")
