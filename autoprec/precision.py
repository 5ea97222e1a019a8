"""The precisions a layer can train in, and the number formats each one means.

A layer's *precision* names what its matrix work uses; master weights always stay fp32.

| precision | forward operands | backward (output gradient) | scaled |
|-----------|------------------|----------------------------|--------|
| fp32      | fp32             | fp32                       | no     |
| tf32      | tf32             | tf32                       | no     |
| bf16      | bf16             | bf16                       | no     |
| fp16      | fp16             | fp16                       | no (loss scaling guards it) |
| fp8       | fp8_e4m3         | fp8_e5m2                   | yes, per tensor (current)  |

fp8 is torchao's float8 training recipe (tensorwise): each operand is scaled from its own
current amax, as ``torchao.float8.Float8Linear`` does natively and the emulate mode reproduces.
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
        storage_bytes: bytes one value occupies in memory (TF32 lives in a 32-bit container).
        has_inf: whether the format encodes infinities. Formats without (OCP ``e4m3fn``) keep
            only the all-ones pattern for NaN, so their top binade has one value fewer.
        overflow: what round-to-nearest does with a magnitude past the largest finite value:
            ``"inf"`` (IEEE formats), ``"saturate"`` (clamp to ``±max_finite``, infinities
            included: torch's cast to ``float8_e4m3fn`` and NVIDIA's ``cvt.rn.satfinite`` do
            this) or ``"nan"`` (the OCP non-saturating mode for formats without inf).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    storage_bytes: int
    has_inf: bool = True
    overflow: str = "inf"

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
        )
    }
)


class Precision(str, Enum):
    """A layer precision; compares equal to its string value (``Precision.BF16 == "bf16"``)."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    def __str__(self) -> str:
        return self.value

    @property
    def forward_format(self) -> str:
        """Format of the layer's operands (input and weight) in forward."""
        return "fp8_e4m3" if self is Precision.FP8 else self.value

    @property
    def backward_format(self) -> str:
        """Format of the gradient with respect to the layer's output in backward."""
        return "fp8_e5m2" if self is Precision.FP8 else self.value

    @property
    def bits(self) -> int:
        """Significant bits of the forward format (fp32 32, tf32 19, bf16 and fp16 16, fp8 8)."""
        return FORMAT_FACTS[self.forward_format].bits

    @property
    def bytes_ratio(self) -> float:
        """Bytes per element at the forward format, relative to fp32's 4 (tf32: 1.0)."""
        return FORMAT_FACTS[self.forward_format].storage_bytes / 4

    @property
    def scaled(self) -> bool:
        """Whether casts use per-tensor scaling (from the current amax, as torchao's)."""
        return self is Precision.FP8

    @property
    def width(self) -> int:
        """Rank from narrowest (0) to widest; wider formats are safer and slower."""
        return _ORDER.index(self)

    def wider(self) -> Precision | None:
        """The next wider precision (fp8 -> fp16 -> bf16 -> tf32 -> fp32), None for fp32.

        fp16 widens to bf16 for its range (the usual fix for fp16 overflow), bf16 to tf32 for
        its mantissa.
        """
        i = self.width
        return _ORDER[i + 1] if i + 1 < len(_ORDER) else None


_ORDER = [Precision.FP8, Precision.FP16, Precision.BF16, Precision.TF32, Precision.FP32]

PRECISION_NAMES = tuple(p.value for p in Precision)


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
