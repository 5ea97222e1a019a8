"""Number formats and precision-emulation kernels (``autoprec.kernels``).

- :mod:`.formats`: the format registry (``get_format``).
- :mod:`.quantize`: bit-exact rounding onto a format's grid (``quantize``).
- :mod:`.scaling`: per-tensor scaling for fp8/fp16: current scaling as torchao's float8
  training (``DynamicScaledCast``, ``amax_to_scale``) and delayed scaling (``ScaledCast``).
- :mod:`.autograd`: rounding in forward and backward (``fake_quantize``).
- :mod:`.mx`: block-scaled MX and NVFP4 formats (``mx_round``, ``nvfp4_round``) and an MX
  training linear (``mx_linear``), bit for bit as torchao's emulated MX path.

This package imports nothing else of autoprec, so the runtime and user code can build on it.
"""

from .autograd import Caster, fake_quantize
from .formats import FORMATS, Format, format_names, get_format
from .mx import (
    MX_ELEMENTS,
    MX_SCALING_MODES,
    NVFP4_BLOCK_SIZE,
    BlockQuantized,
    check_mx_options,
    mx_quantize,
    mx_round,
    nvfp4_quantize,
    nvfp4_round,
    nvfp4_tensor_scale,
)
from .mx_linear import MXLinearFunction, mx_linear
from .quantize import ROUNDING_MODES, quantize, quantize_counted, quantize_with_counts
from .scaling import (
    AMAX_EPS,
    AMAX_RULES,
    DynamicScaledCast,
    ScaledCast,
    ScaledTensor,
    amax_to_scale,
)

__all__ = [
    "AMAX_EPS",
    "AMAX_RULES",
    "DynamicScaledCast",
    "FORMATS",
    "MX_ELEMENTS",
    "MX_SCALING_MODES",
    "NVFP4_BLOCK_SIZE",
    "ROUNDING_MODES",
    "BlockQuantized",
    "Caster",
    "Format",
    "MXLinearFunction",
    "ScaledCast",
    "ScaledTensor",
    "amax_to_scale",
    "check_mx_options",
    "fake_quantize",
    "format_names",
    "get_format",
    "mx_linear",
    "mx_quantize",
    "mx_round",
    "nvfp4_quantize",
    "nvfp4_round",
    "nvfp4_tensor_scale",
    "quantize",
    "quantize_counted",
    "quantize_with_counts",
]
