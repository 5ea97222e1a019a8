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
``torch.compile``, which is what makes it run near memory speed: one graph for every format
and size (the format's constants are inputs; tf32, which needs neither the subnormal grid nor
the overflow patches, has a leaner graph of its own), built once eager rounding has cost about
as much as building it would (:mod:`.dispatch`). Overflows and underflows are counted on the
bits in the same loop. bf16 and fp16 (:data:`CAST_FORMATS`) round through torch's own cast
instead, the same bits in a graph each: inductor's CPU code reads a float's bits one element
at a time, so the cast's vector instructions run their loop about twice as fast, and eagerly a
cast is one pass where the bit expression is about twenty.

Stochastic rounding adds a uniform random integer below the kept bits before clearing them, so
a value rounds up with probability equal to its distance from the lower grid point over the
spacing, which makes the rounding unbiased. In the subnormal range the comparison uses 24 random
bits, so the expectation is exact up to 2**-24 of the spacing there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import Kernel
from .formats import Format, get_format

__all__ = [
    "check_rounding",
    "quantize",
    "quantize_counted",
    "quantize_with_counts",
    "ROUNDING_MODES",
]

ROUNDING_MODES = ("nearest", "stochastic")

_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000
_SIGN_BIT = -(1 << 31)  # 0x80000000 as an int32
_RANDOM_BITS = 24


def round_bits(
    x: Tensor, rnd: Tensor | None, c: dict, wide: bool = False, in_range: bool = False
) -> Tensor:
    """The rounding expression on a float32 tensor; ``rnd`` holds random bits for stochastic.

    Returns the rounded magnitude's bits (no sign yet), as int32. ``c`` holds the format's
    constants (:func:`_constants`), as Python numbers (eager) or 0-dim tensors (the compiled
    graph, shared by every format). Written with torch operations only, so it runs eagerly and
    under ``torch.compile``. ``wide=True`` is for a format with fp32's range that overflows to
    inf (bf16, tf32; :func:`is_wide`): it never takes the subnormal grid (``min_normal`` is 0),
    and a carry out of the kept mantissa bits lands on inf's bits by itself, as does an
    infinity, so only NaN needs patching: the same bits in a third of the operations.
    ``in_range=True`` is for values already clamped to the largest finite value (a saturating
    scaled cast): nothing can overflow, so the overflow and infinity patches are left out.
    """
    mag = x.view(torch.int32) & 0x7FFFFFFF
    clamped = torch.clamp_max(mag, _INF_BITS)  # keeps the integer adds below from wrapping
    if rnd is None:  # round to nearest, ties to even
        increment = ((clamped >> c["shift"]) & 1) + c["half"]
    else:
        increment = rnd & c["low_mask"]
    rounded = (clamped + increment) & c["keep_mask"]

    # values below the format's smallest normal: fixed subnormal grid (never for bf16/tf32,
    # whose min_normal is 0 here: their subnormals are fp32's, which the bit rounding handles)
    if not wide:
        rounded = _subnormal_grid(clamped, rnd, rounded, c)
    if not (wide or in_range):
        overflow = (clamped >= c["threshold"]) if rnd is None else (rounded > c["max_bits"])
        # saturate: finite overflows clamp to the largest finite value, infinities keep the
        # format's rule (inf, or NaN without inf); else both take the format's rule
        rounded = torch.where(overflow, c["overflow_to"], rounded)
        rounded = torch.where(clamped >= _INF_BITS, c["inf_to"], rounded)
    return torch.where(mag > _INF_BITS, mag, rounded)  # NaN stays NaN, payload kept


def is_wide(fmt: Format, saturate: bool) -> bool:
    """Whether ``fmt`` rounds with ``round_bits(..., wide=True)``: fp32's range, overflow to
    inf, no saturation."""
    return fmt.same_range_as_fp32 and fmt.overflow == "inf" and not saturate


def _subnormal_grid(clamped: Tensor, rnd: Tensor | None, rounded: Tensor, c: dict) -> Tensor:
    """``rounded`` with the magnitudes below the format's smallest normal rounded on its fixed
    subnormal grid instead, with ``round`` (ties to even): exact, as the scale is a power of
    two."""
    absx = clamped.view(torch.float32)
    scaled = absx * c["inv_quantum"]  # exact: power-of-two scale, result < 2**(mantissa+1)
    if rnd is None:
        steps = torch.round(scaled)
    else:
        low = torch.floor(scaled)
        uniform = rnd.to(torch.float32) * (2.0**-_RANDOM_BITS)
        steps = low + (uniform < (scaled - low)).to(torch.float32)
    sub = (steps * c["quantum"]).view(torch.int32)
    return torch.where(clamped < c["min_normal"], sub, rounded)


def with_sign(x: Tensor, rounded: Tensor) -> Tensor:
    """The float32 result: the rounded magnitude of :func:`round_bits` with ``x``'s sign."""
    return (rounded | (x.view(torch.int32) & _SIGN_BIT)).view(torch.float32)


def _counts(x: Tensor, rounded: Tensor, c: dict, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Overflows (a value beyond the format's largest finite value, an infinity or a NaN: every
    value whose result is not finite or was clamped) and underflows (a non-zero value that
    became zero), on the bits: no second pass."""
    mag = x.view(torch.int32) & 0x7FFFFFFF
    overflows = (mag > c["max_bits"]).sum(dtype=dtype)
    underflows = ((rounded == 0) & (mag != 0)).sum(dtype=dtype)
    return overflows, underflows


def _constants(fmt: Format, saturate: bool) -> dict:
    """The format's constants for :func:`round_bits`, as Python numbers."""
    shift = 23 - fmt.mantissa_bits
    nan_or_inf = {"inf": _INF_BITS, "nan": _NAN_BITS, "saturate": fmt.max_finite_bits}
    rule = nan_or_inf[fmt.overflow]
    reduced = not fmt.same_range_as_fp32
    return {
        "shift": shift,
        "half": (1 << (shift - 1)) - 1,
        "low_mask": (1 << shift) - 1,
        "keep_mask": ~((1 << shift) - 1),
        "min_normal": fmt.min_normal_bits if reduced else 0,
        "threshold": fmt.overflow_threshold_bits,
        "max_bits": fmt.max_finite_bits,
        "overflow_to": fmt.max_finite_bits if saturate else rule,
        "inf_to": rule,
        # bf16's 2**133 has no float32; any value does, as the subnormal path is never taken
        "inv_quantum": 1.0 / fmt.min_subnormal if reduced else 1.0,
        "quantum": fmt.min_subnormal if reduced else 1.0,
    }


_INTS = tuple(
    "shift half low_mask keep_mask min_normal threshold max_bits overflow_to inf_to".split()
)
_FLOATS = ("inv_quantum", "quantum")
_tensor_constants: dict[tuple, tuple[Tensor, Tensor, Format]] = {}


def constant_tensors(fmt: Format, saturate: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """The constants as two small tensors (int32, float32), the compiled graph's inputs."""
    key = (id(fmt), saturate, device)  # Format's dataclass hash is slow; fmt is kept below
    if key not in _tensor_constants:
        c = _constants(fmt, saturate)
        _tensor_constants[key] = (
            torch.tensor([c[k] for k in _INTS], dtype=torch.int32, device=device),
            torch.tensor([c[k] for k in _FLOATS], dtype=torch.float32, device=device),
            fmt,
        )
    return _tensor_constants[key][:2]


def unpack_constants(ints: Tensor, floats: Tensor) -> dict:
    """The constants of :func:`constant_tensors` by name, as 0-dim tensors (inside a graph)."""
    return {
        **dict(zip(_INTS, ints.unbind(), strict=True)),
        **dict(zip(_FLOATS, floats.unbind(), strict=True)),
    }


def _nearest_graph(flat: Tensor, ints: Tensor, floats: Tensor) -> tuple[Tensor, Tensor]:
    """Round to nearest and count, every format in one graph; the counts come back as one
    int32 pair (the graph takes at most 2**31 - 1 values)."""
    c = unpack_constants(ints, floats)
    rounded = round_bits(flat, None, c)
    return with_sign(flat, rounded), torch.stack(_counts(flat, rounded, c, torch.int32))


def _wide_graph(flat: Tensor, ints: Tensor, floats: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_nearest_graph` for the formats of :func:`is_wide`, in one graph of their own."""
    c = unpack_constants(ints, floats)
    rounded = round_bits(flat, None, c, wide=True)
    return with_sign(flat, rounded), torch.stack(_counts(flat, rounded, c, torch.int32))


def _stochastic_graph(flat: Tensor, rnd: Tensor, ints: Tensor, floats: Tensor) -> Tensor:
    return with_sign(flat, round_bits(flat, rnd, unpack_constants(ints, floats)))


def _cast_values(x32: Tensor, fmt: Format) -> tuple[Tensor, Tensor]:
    """``(rounded, cast)``: ``x32`` through torch's cast to ``fmt``'s dtype and back, NaN kept
    with its payload in ``rounded``."""
    cast = x32.to(fmt.torch_dtype).to(torch.float32)
    return torch.where(x32 != x32, x32, cast), cast  # x32 != x32: a vector compare compiled


def _cast_round(x32: Tensor, fmt: Format, count_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Round to nearest through torch's own cast to ``fmt``'s dtype (:data:`CAST_FORMATS`):
    the same bits as :func:`round_bits` (NaN keeps its payload here too) and counts as
    :func:`_counts`, without the int32 view, which inductor's CPU code does element by element.
    Compiled, the cast is kept by ``emulate_precision_casts`` (:mod:`.dispatch`)."""
    out, cast = _cast_values(x32, fmt)
    overflows = (~(x32.abs() <= fmt.max_finite)).sum(dtype=count_dtype)  # NaN counts, as inf
    underflows = ((cast == 0) & (x32 != 0)).sum(dtype=count_dtype)
    return out, torch.stack((overflows, underflows))


def splits(fmt: Format) -> bool:
    """Whether :func:`round_split` can round ``fmt``'s in-range values: a reduced format whose
    largest value times the splitting constant stays finite in fp32 (fp16, fp8; not bf16)."""
    return not fmt.same_range_as_fp32 and fmt.max_finite * _splitter(fmt) < 2.0**127


def _splitter(fmt: Format) -> float:
    return float(2 ** (23 - fmt.mantissa_bits) + 1)


def round_split(v: Tensor, fmt: Format) -> Tensor:
    """``v`` rounded to nearest even onto ``fmt``'s grid, in float arithmetic alone, for values
    within ``±fmt.max_finite`` (a saturating cast's clamped values; NaN stays NaN) of a format
    of :func:`splits`: the same bits as torch's cast, at about twice the speed of inductor's CPU
    code for an fp8 cast, which converts in software.

    A normal value is Veltkamp's split, ``c = v * (2**s + 1)``, ``c - (c - v)`` with ``s`` the
    dropped mantissa bits: the value's leading ``mantissa_bits + 1`` bits, rounded to nearest
    even (tests/kernels/test_quantize.py checks every fp32 value of several binades, ties
    included); below the smallest normal, the fixed subnormal grid (``round`` is ties to even;
    the power-of-two scalings are exact). Needs each operation rounded on its own: no fused
    multiply-add, which inductor's CPU flags leave off (``-ffp-contract=off``), as eager does;
    GPU compilers may contract, so the compiled graphs use it on the CPU only.
    """
    c = v * _splitter(fmt)
    normal = c - (c - v)
    sub = torch.round(v * (1.0 / fmt.min_subnormal)) * fmt.min_subnormal
    return torch.where(v.abs() < fmt.min_normal, sub, normal)


#: Formats whose torch cast is round-to-nearest-even with the format's own overflow rule
#: (inf), so that :func:`_cast_round` gives :func:`round_bits`' bits; each has a graph of its
#: own (tests/kernels/test_quantize.py checks the bits against the float64 reference).
CAST_FORMATS = ("bf16", "fp16")


def _cast_kernel(name: str) -> Kernel:
    fmt = get_format(name)

    def graph(flat: Tensor) -> tuple[Tensor, Tensor]:
        return _cast_round(flat, fmt, torch.int32)

    return Kernel(f"quantize_{name}", graph)


_NEAREST = Kernel("quantize_nearest", _nearest_graph)
_WIDE = Kernel("quantize_wide", _wide_graph)
_CASTS = {name: _cast_kernel(name) for name in CAST_FORMATS}
_STOCHASTIC = Kernel("quantize_stochastic", _stochastic_graph)
GRAPH_MAX_NUMEL = (1 << 31) - 1  # counts are int32 in the graph


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
        backend: ``"auto"`` (compiled once that pays, :mod:`.dispatch`), ``"eager"`` or
            ``"compiled"``; all give identical bits.

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
    if rnd is None:
        return _round_nearest(x32, fmt, saturate, backend)[0]
    out = _STOCHASTIC.run(
        (x32.detach().reshape(-1), rnd.reshape(-1)),
        constant_tensors(fmt, saturate, x32.device),
        lambda: with_sign(x32, round_bits(x32, rnd, _constants(fmt, saturate))),
        backend,
    )
    return shaped(out, x32.shape)


def shaped(flat: Tensor, shape: torch.Size) -> Tensor:
    """A flat kernel result in ``shape``, not a view: a custom autograd function returning it
    may see it modified in place (``ReLU(inplace=True)`` after a layer)."""
    # the sizes unpacked: a torch.Size argument costs a microsecond more to parse
    return (flat.view(*shape) if shape else flat.view(shape)).detach()


def _round_nearest(
    x32: Tensor, fmt: Format, saturate: bool, backend: str, count: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``(rounded, counts)``: counts is an int (overflows, underflows) pair when compiled or
    asked for, else None."""

    if not saturate and fmt.name in _CASTS:
        return _cast_nearest(x32, fmt, backend, count)
    wide = is_wide(fmt, saturate)

    def eager() -> tuple[Tensor, Tensor | None]:
        c = _constants(fmt, saturate)
        rounded = round_bits(x32, None, c, wide)
        counts = torch.stack(_counts(x32, rounded, c, torch.int64)) if count else None
        return with_sign(x32, rounded), counts

    if x32.numel() > GRAPH_MAX_NUMEL:
        return eager()
    flat = x32.detach().reshape(-1)  # rounding is not differentiable
    kernel = _WIDE if wide else _NEAREST
    out = kernel.run((flat,), constant_tensors(fmt, saturate, x32.device), eager, backend)
    return shaped(out[0], x32.shape), out[1]


def _cast_nearest(
    x32: Tensor, fmt: Format, backend: str, count: bool
) -> tuple[Tensor, Tensor | None]:
    """:func:`_round_nearest` for :data:`CAST_FORMATS`: eagerly a cast and a ``where`` (the
    counts only when asked for), compiled one fused loop."""

    def eager() -> tuple[Tensor, Tensor | None]:
        if count:
            return _cast_round(x32, fmt, torch.int64)
        return _cast_values(x32, fmt)[0], None

    if x32.numel() > GRAPH_MAX_NUMEL:
        return eager()
    out = _CASTS[fmt.name].run((x32.detach().reshape(-1),), (), eager, backend)
    return shaped(out[0], x32.shape), out[1]


def quantize_counted(
    x: Tensor, fmt: str | Format, saturate: bool = False, *, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """:func:`quantize_with_counts` with both counts in one tensor: ``(rounded, counts)``,
    ``counts`` an integer tensor ``[overflows, underflows]`` on ``x``'s device (int32 from the
    compiled kernel, int64 from the eager one), for callers that sum counts over many calls."""
    _check_input(x)
    fmt = get_format(fmt)
    _check_backend(backend)
    x32 = x.float()
    if fmt.mantissa_bits == 23 and fmt.same_range_as_fp32:
        zero = torch.zeros((), dtype=torch.int64, device=x32.device)
        counts = torch.stack(((~torch.isfinite(x32)).sum(), zero))
        return x32.clone() if x32 is x else x32, counts
    return _round_nearest(x32, fmt, saturate, backend, count=True)


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
    rounded, counts = quantize_counted(x, fmt, saturate, backend=backend)
    counts = counts.to(torch.int64)
    return rounded, counts[0], counts[1]
