"""Bit-exact rounding of float tensors onto a format's grid (the emulation kernel).

``quantize(x, fmt)`` returns float32 values that lie on ``fmt``'s grid. Round-to-nearest-even
matches torch's own casts bit for bit (``x.float().to(dtype).float()``), subnormals, signed
zeros, infinities, NaN and overflow included. TF32 keeps 10 mantissa bits with
round-to-nearest-even, as cuBLAS documents for its TF32 conversion; some hardware paths truncate
instead (round toward zero), which this kernel does not model.

How it works: on the int32 view of the fp32 bits, a value in the format's normal range is
rounded by adding the rounding increment below the kept mantissa bits and clearing them (a carry
into the exponent field is the correct result); a value below the format's smallest normal is
rounded on the fixed subnormal grid with ``round`` (ties to even), which is exact because the
scale is a power of two. Overflow, infinities and NaN are then patched in with ``where``. The
same expression runs eagerly (the portable fallback) or fused into one loop by
``torch.compile`` for large tensors, which is what makes it run near memory speed.

Stochastic rounding adds a uniform random integer below the kept bits before clearing them, so
a value rounds up with probability equal to its distance from the lower grid point over the
spacing, which makes the rounding unbiased. In the subnormal range the comparison uses 24 random
bits, so the expectation is exact up to 2**-24 of the spacing there.
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from .formats import Format, get_format

__all__ = ["check_rounding", "quantize", "quantize_with_counts", "ROUNDING_MODES"]

ROUNDING_MODES = ("nearest", "stochastic")

_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000
_SIGN_BIT = -(1 << 31)  # 0x80000000 as an int32
_RANDOM_BITS = 24

# Tensors at least this large go through the compiled kernel when it is available; below it the
# fixed cost of a compiled call outweighs the fusion. AUTOPREC_COMPILE=0 forces the eager path,
# AUTOPREC_COMPILE=1 forces compilation for every size.
_COMPILE_MIN_NUMEL = 1 << 16


def _round_bits(
    x: Tensor,
    rnd: Tensor | None,
    *,
    shift: int,
    reduced_range: bool,
    min_normal_bits: int,
    inv_quantum: float,
    quantum: float,
    threshold_bits: int,
    max_bits: int,
    overflow_bits: int,
    inf_bits_out: int,
    saturate: bool,
) -> Tensor:
    """The rounding expression on a float32 tensor; ``rnd`` holds random bits for stochastic.

    Written with torch operations only, so it runs eagerly and under ``torch.compile``.
    """
    bits = x.view(torch.int32)
    sign = bits & _SIGN_BIT
    mag = bits & 0x7FFFFFFF
    clamped = torch.clamp_max(mag, _INF_BITS)  # keeps the integer adds below from wrapping
    low_mask = (1 << shift) - 1
    if rnd is None:  # round to nearest, ties to even
        increment = ((clamped >> shift) & 1) + ((1 << (shift - 1)) - 1)
    else:
        increment = rnd & low_mask
    rounded = (clamped + increment) & ~low_mask

    if reduced_range:  # values below the format's smallest normal: fixed subnormal grid
        absx = clamped.view(torch.float32)
        scaled = absx * inv_quantum  # exact: power-of-two scale, result < 2**(mantissa+1)
        if rnd is None:
            steps = torch.round(scaled)
        else:
            low = torch.floor(scaled)
            uniform = rnd.to(torch.float32) * (2.0**-_RANDOM_BITS)
            steps = low + (uniform < (scaled - low)).to(torch.float32)
        sub = (steps * quantum).view(torch.int32)
        rounded = torch.where(clamped < min_normal_bits, sub, rounded)

    overflow = (clamped >= threshold_bits) if rnd is None else (rounded > max_bits)
    if saturate:  # finite overflows clamp to the largest finite value; infinities stay
        rounded = torch.where(overflow, max_bits, rounded)
        rounded = torch.where(clamped >= _INF_BITS, inf_bits_out, rounded)
    else:
        rounded = torch.where(overflow, overflow_bits, rounded)
    rounded = torch.where(mag > _INF_BITS, mag, rounded)  # NaN stays NaN, payload kept
    return (rounded | sign).view(torch.float32)


def _kernel_constants(fmt: Format) -> dict:
    overflow_bits = {"inf": _INF_BITS, "nan": _NAN_BITS, "saturate": fmt.max_finite_bits}
    nan_or_inf = overflow_bits[fmt.overflow]
    return {
        "shift": 23 - fmt.mantissa_bits,
        "reduced_range": not fmt.same_range_as_fp32,
        "min_normal_bits": fmt.min_normal_bits,
        "inv_quantum": 1.0 / fmt.min_subnormal,
        "quantum": fmt.min_subnormal,
        "threshold_bits": fmt.overflow_threshold_bits,
        "max_bits": fmt.max_finite_bits,
        "overflow_bits": nan_or_inf,
        "inf_bits_out": nan_or_inf,
    }


_eager_kernels: dict[tuple, Callable] = {}
_compiled_kernels: dict[tuple, Callable] = {}
_compile_broken = False


def _count(x: Tensor, rounded: Tensor, max_finite: float) -> tuple[Tensor, Tensor]:
    """Overflows (a non-finite result, or a value beyond the format's range that was clamped)
    and underflows (a non-zero value that became zero)."""
    overflows = (~torch.isfinite(rounded) | (x.abs() > max_finite)).sum()
    underflows = ((rounded == 0) & (x != 0)).sum()
    return overflows, underflows


def _eager_kernel(fmt: Format, saturate: bool, count: bool = False) -> Callable:
    key = (fmt, saturate, count)
    if key not in _eager_kernels:
        constants = _kernel_constants(fmt)
        max_finite = fmt.max_finite

        if count:

            def kernel(x: Tensor, rnd: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
                rounded = _round_bits(x, rnd, saturate=saturate, **constants)
                return (rounded, *_count(x, rounded, max_finite))

        else:

            def kernel(x: Tensor, rnd: Tensor | None) -> Tensor:
                return _round_bits(x, rnd, saturate=saturate, **constants)

        _eager_kernels[key] = kernel
    return _eager_kernels[key]


def _compiled_kernel(
    fmt: Format, saturate: bool, stochastic: bool, count: bool = False
) -> Callable:
    key = (fmt, saturate, stochastic, count)
    if key not in _compiled_kernels:
        eager = _eager_kernel(fmt, saturate, count)
        # Dynamo keeps its cache on the code object. Every variant gets a code object of its own
        # so that the format constants stay compile-time constants (fusing into one loop)
        # instead of being turned into symbolic inputs once a second variant shows up.
        name = f"quantize_{fmt.name}_{int(saturate)}{int(stochastic)}{int(count)}"
        code = eager.__code__.replace(co_name=name)
        variant = types.FunctionType(code, eager.__globals__, name, None, eager.__closure__)
        _compiled_kernels[key] = torch.compile(variant, dynamic=False)
    return _compiled_kernels[key]


def _use_compiled(x: Tensor) -> bool:
    if _compile_broken or torch.compiler.is_compiling():
        return False
    setting = os.environ.get("AUTOPREC_COMPILE", "")
    if setting == "0":
        return False
    return setting == "1" or x.numel() >= _COMPILE_MIN_NUMEL


def _compiled_for(x: Tensor, backend: str) -> bool:
    # Sizes 0 and 1 are always specialised by dynamo; they take the eager path.
    return x.numel() > 1 and (backend == "compiled" or (backend == "auto" and _use_compiled(x)))


def check_rounding(rounding: str) -> None:
    """Raise ValueError unless ``rounding`` is one of :data:`ROUNDING_MODES`."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(
            f"unknown rounding {rounding!r}; expected one of {', '.join(ROUNDING_MODES)}"
        )


def _check_backend(backend: str) -> None:
    if backend not in ("auto", "eager", "compiled"):
        raise ValueError(f"unknown backend {backend!r}; expected auto, eager or compiled")


def _check_input(x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.element_size() < 2:
        raise TypeError(
            f"quantize expects a float32, float16 or bfloat16 tensor, got {x.dtype}; "
            "convert integer or fp8 data with .float() first"
        )
    if x.dtype == torch.float64:
        raise TypeError(
            "quantize expects a float32, float16 or bfloat16 tensor, got torch.float64; "
            "values beyond fp32 would be rounded twice, convert with .float() deliberately"
        )


def quantize(
    x: Tensor,
    fmt: str | Format,
    rounding: str = "nearest",
    saturate: bool = False,
    generator: torch.Generator | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Round ``x`` onto the grid of ``fmt`` and return the values as float32.

    Args:
        x: a float32, float16 or bfloat16 tensor of any shape, on any device.
        fmt: format name (``"bf16"``, ``"fp8_e4m3"``, ...) or a :class:`Format`.
        rounding: ``"nearest"`` (round to nearest, ties to even, as torch's casts) or
            ``"stochastic"`` (unbiased stochastic rounding).
        saturate: clamp finite values that overflow to ``±max_finite`` instead of applying the
            format's own overflow rule (inf for IEEE formats; fp8_e4m3 saturates anyway, as
            torch's cast does). Infinite inputs keep the format's rule: inf where it has inf.
            NaN always stays NaN.
        generator: random source for stochastic rounding (on ``x``'s device).
        backend: ``"auto"`` (compiled for large tensors when torch.compile works), ``"eager"``
            or ``"compiled"``; all give identical bits.

    Returns:
        A new float32 tensor shaped like ``x``; for ``fmt="fp32"`` the float32 values of ``x``.

    Raises:
        TypeError: ``x`` is not a float32/float16/bfloat16 tensor.
        ValueError: unknown format, rounding mode or backend.

    Example:
        >>> quantize(torch.tensor([1.0 + 2**-9]), "bf16")
        tensor([1.])
    """
    _check_input(x)
    fmt = get_format(fmt)
    check_rounding(rounding)
    _check_backend(backend)
    x32 = x.float()
    if fmt.mantissa_bits == 23 and fmt.same_range_as_fp32:  # fp32: already on the grid
        return x32.clone() if x32 is x else x32

    rnd = None
    if rounding == "stochastic":
        rnd = torch.randint(
            0,
            1 << _RANDOM_BITS,
            x32.shape,
            generator=generator,
            device=x32.device,
            dtype=torch.int32,
        )
    if _compiled_for(x32, backend):
        return _run_compiled(x32, rnd, fmt, saturate, strict=backend == "compiled")
    return _eager_kernel(fmt, saturate)(x32, rnd)


def _run_compiled(
    x: Tensor, rnd: Tensor | None, fmt: Format, saturate: bool, strict: bool, count: bool = False
):
    global _compile_broken
    # One graph per variant for every size: flatten, and mark the length dynamic so that a new
    # shape does not recompile (the constants stay static, see _compiled_kernel).
    flat = x.detach().reshape(-1)  # rounding is not differentiable; one graph, no grad guard
    flat_rnd = None if rnd is None else rnd.reshape(-1)
    torch._dynamo.mark_dynamic(flat, 0)
    if flat_rnd is not None:
        torch._dynamo.mark_dynamic(flat_rnd, 0)
    try:
        out = _compiled_kernel(fmt, saturate, rnd is not None, count)(flat, flat_rnd)
    except Exception as err:  # no C++ compiler, unsupported platform, ...
        if strict:
            raise
        _compile_broken = True
        warnings.warn(
            f"torch.compile failed for the quantize kernel ({type(err).__name__}: {err}); "
            "using the eager kernel, which gives the same bits more slowly",
            RuntimeWarning,
            stacklevel=3,
        )
        return _eager_kernel(fmt, saturate, count)(x, rnd)
    if count:
        return (out[0].view(x.shape), out[1], out[2])
    return out.view(x.shape)


def quantize_with_counts(
    x: Tensor, fmt: str | Format, saturate: bool = False, *, backend: str = "auto"
) -> tuple[Tensor, Tensor, Tensor]:
    """Round to nearest like :func:`quantize`, and count what the rounding lost on the way.

    Returns:
        ``(rounded, overflows, underflows)``: the float32 result and two 0-dim int64 tensors on
        ``x``'s device: overflows are values whose result is not finite or that lay beyond the
        format's largest finite value (turned into inf or clamped); underflows are non-zero
        values that became zero. Counting fuses into the compiled kernel, so it costs little,
        and nothing is read back to the host.
    """
    _check_input(x)
    fmt = get_format(fmt)
    _check_backend(backend)
    x32 = x.float()
    if fmt.mantissa_bits == 23 and fmt.same_range_as_fp32:
        zero = torch.zeros((), dtype=torch.int64, device=x32.device)
        return x32.clone() if x32 is x else x32, (~torch.isfinite(x32)).sum(), zero
    if _compiled_for(x32, backend):
        return _run_compiled(x32, None, fmt, saturate, strict=backend == "compiled", count=True)
    return _eager_kernel(fmt, saturate, count=True)(x32, None)
