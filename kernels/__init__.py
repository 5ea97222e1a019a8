"""Number formats and precision-emulation kernels (``autoprec.kernels``).

- :mod:`.formats`: the format registry (``get_format``).
- :mod:`.quantize`: bit-exact rounding onto a format's grid (``quantize``).
- :mod:`.scaling`: per-tensor scaling for fp8/fp16: current scaling as torchao's float8
  training (``DynamicScaledCast``, ``amax_to_scale``) and delayed scaling (``ScaledCast``).
- :mod:`.autograd`: rounding in forward and backward (``fake_quantize``).
- :mod:`.mx`: block-scaled MX and NVFP4 formats (``mx_round``, ``nvfp4_round``) and an MX
  training linear (``mx_linear``), bit for bit as torchao's emulated MX path.
- :mod:`.nvfp4` and :mod:`.nvfp4_linear`: NVFP4 as Transformer Engine trains in it (2-D weight
  tiles, stochastic rounding, random Hadamard transform; ``nvfp4_linear``).
- :mod:`.block_fp8`: fp8 with 1x128 / 128x128 block scales as torchao's blockwise fp8 training
  (``block_fp8_linear``).

This package imports nothing else of autoprec, so the runtime and user code can build on it.
"""

from .autograd import Caster, fake_quantize
from .block_fp8 import (
    FP8_BLOCK_EPS,
    block_fp8_linear,
    fp8_block_quantize_lhs,
    fp8_block_quantize_rhs,
    fp8_block_quantize_weight,
)
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
from .nvfp4 import (
    RHT_SIZE,
    TE_RHT_SIGNS,
    NVFP4Blocks,
    hadamard_matrix,
    nvfp4_mm,
    nvfp4_te_quantize,
    nvfp4_te_round,
    rht,
    rht_matrix,
)
from .nvfp4_linear import NVFP4_GEMMS, NVFP4Options, nvfp4_linear
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
    "FORMATS",
    "FP8_BLOCK_EPS",
    "MX_ELEMENTS",
    "MX_SCALING_MODES",
    "NVFP4_BLOCK_SIZE",
    "NVFP4_GEMMS",
    "RHT_SIZE",
    "ROUNDING_MODES",
    "TE_RHT_SIGNS",
    "BlockQuantized",
    "Caster",
    "DynamicScaledCast",
    "Format",
    "MXLinearFunction",
    "NVFP4Blocks",
    "NVFP4Options",
    "ScaledCast",
    "ScaledTensor",
    "amax_to_scale",
    "block_fp8_linear",
    "check_mx_options",
    "fake_quantize",
    "format_names",
    "fp8_block_quantize_lhs",
    "fp8_block_quantize_rhs",
    "fp8_block_quantize_weight",
    "get_format",
    "hadamard_matrix",
    "mx_linear",
    "mx_quantize",
    "mx_round",
    "nvfp4_linear",
    "nvfp4_mm",
    "nvfp4_quantize",
    "nvfp4_round",
    "nvfp4_te_quantize",
    "nvfp4_te_round",
    "nvfp4_tensor_scale",
    "quantize",
    "quantize_counted",
    "quantize_with_counts",
    "rht",
    "rht_matrix",
]
