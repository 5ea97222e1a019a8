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

from enum import Enum


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
