"""Number formats and precision-emulation kernels (``autoprec.kernels``).

- :mod:`.formats`: the format registry (``get_format``).
- :mod:`.quantize`: bit-exact rounding onto a format's grid (``quantize``).
- :mod:`.scaling`: per-tensor delayed scaling for fp8/fp16 (``ScaledCast``).
- :mod:`.autograd`: rounding in forward and backward (``fake_quantize``).

This package imports nothing else of autoprec, so the runtime and user code can build on it.
"""

from .autograd import Caster, fake_quantize
from .formats import FORMATS, Format, format_names, get_format
from .quantize import ROUNDING_MODES, quantize, quantize_with_counts
from .scaling import AMAX_RULES, ScaledCast, ScaledTensor

__all__ = [
    "AMAX_RULES",
    "FORMATS",
    "ROUNDING_MODES",
    "Caster",
    "Format",
    "ScaledCast",
    "ScaledTensor",
    "fake_quantize",
    "format_names",
    "get_format",
    "quantize",
    "quantize_with_counts",
]
