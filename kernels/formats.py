"""Registry of the floating-point formats autoprec emulates.

Every format is described by its bit layout (exponent bits, mantissa bits, bias) and its special
value convention; the numeric limits (largest finite value, smallest normal and subnormal) are
derived from the layout, not typed in, and the tests check them against ``torch.finfo``.

Example:
    >>> from autoprec.kernels import get_format
    >>> get_format("fp8_e4m3").max_finite
    448.0
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field

import torch

from autoprec.precision import FORMAT_FACTS, FormatFacts

__all__ = ["Format", "FORMATS", "get_format", "format_names"]


def _f32_bits(value: float) -> int:
    """Bit pattern of ``value`` as an IEEE-754 binary32, as a non-negative int."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


@dataclass(frozen=True)
class Format(FormatFacts):
    """A binary floating-point format: its :class:`~autoprec.precision.FormatFacts` (layout,
    storage, infinities and overflow convention), the torch dtype that stores it, and the
    numeric limits derived from the layout.

    Args:
        torch_dtype: the torch dtype that stores this format, when there is one; the other
            arguments are :class:`~autoprec.precision.FormatFacts`'.
    """

    torch_dtype: torch.dtype | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        allowed = ("inf",) if self.has_inf else ("saturate", "nan")
        if self.overflow not in allowed:
            raise ValueError(
                f"overflow {self.overflow!r} does not fit a format with has_inf={self.has_inf}; "
                f"expected one of {', '.join(allowed)}"
            )
        if not 2 <= self.exponent_bits <= 8:
            raise ValueError(
                f"exponent_bits must be in 2..8 (fp32's range), got {self.exponent_bits}"
            )
        if not 1 <= self.mantissa_bits <= 23:
            raise ValueError(f"mantissa_bits must be in 1..23, got {self.mantissa_bits}")

    # --- derived limits -------------------------------------------------------------------------
    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of the largest finite binade."""
        top = (1 << self.exponent_bits) - 1  # the all-ones exponent field
        return (top - 1 if self.has_inf else top) - self.bias

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        return 1 - self.bias

    @property
    def max_finite(self) -> float:
        """Largest finite value."""
        m = self.mantissa_bits
        # With inf (or with neither inf nor NaN: e2m1), the top binade is full; without inf but
        # with NaN (e4m3fn), its all-ones mantissa is NaN.
        top_mantissa = (1 << m) - (2 if self.has_nan and not self.has_inf else 1)
        return (1.0 + top_mantissa / (1 << m)) * 2.0**self.max_exponent

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value."""
        return 2.0**self.min_exponent

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal value (the spacing of values below ``min_normal``)."""
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value."""
        return 2.0**-self.mantissa_bits

    @property
    def same_range_as_fp32(self) -> bool:
        """True when the format only drops mantissa bits of fp32 (bf16, tf32, fp32)."""
        return self.exponent_bits == 8 and self.bias == 127 and self.has_inf

    # fp32 bit patterns used by the kernels
    @property
    def max_finite_bits(self) -> int:
        return _f32_bits(self.max_finite)

    @property
    def min_normal_bits(self) -> int:
        return _f32_bits(self.min_normal)

    @property
    def overflow_threshold_bits(self) -> int:
        """fp32 bit pattern of :attr:`overflow_threshold` (capped at the bits of inf)."""
        try:
            return _f32_bits(self.overflow_threshold)
        except OverflowError:  # fp32 itself: the threshold rounds past fp32's range
            return 0x7F800000

    @property
    def overflow_threshold(self) -> float:
        """Smallest magnitude that round-to-nearest sends past ``max_finite``.

        It is the midpoint between ``max_finite`` and the next grid point the exponent field
        would give. The largest finite mantissa is odd for IEEE-style formats, so ties there
        round up; without inf, the midpoint (464 for e4m3fn) also counts as overflow.
        """
        ulp = 2.0 ** (self.max_exponent - self.mantissa_bits)
        return self.max_finite + ulp / 2

    def __str__(self) -> str:
        return self.name


_TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

#: The formats of :data:`autoprec.precision.FORMAT_FACTS` (their one table), with torch dtypes.
FORMATS: dict[str, Format] = {
    name: Format(**dataclasses.asdict(facts), torch_dtype=_TORCH_DTYPES.get(name))
    for name, facts in FORMAT_FACTS.items()
}


def format_names() -> list[str]:
    """Names of every registered format, in registry order."""
    return list(FORMATS)


def get_format(name: str | Format) -> Format:
    """Look a format up by name (a :class:`Format` is returned as is).

    Raises:
        ValueError: the name is not registered; the message lists the valid names.
    """
    if isinstance(name, Format):
        return name
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        valid = ", ".join(FORMATS)
        raise ValueError(f"unknown number format {name!r}; expected one of {valid}") from None
