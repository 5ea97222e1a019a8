"""Efficiency factors as a value: the fraction of a device's peak rates a training step reaches.

:class:`Efficiency` and its documented defaults, and :func:`fill_compute`, which completes a
partial measurement. Every source of factors builds this one type: a calibration
(:mod:`autoprec.hardware.calibration`), the published measurements and the defaults
(:mod:`autoprec.hardware.efficiency`, which chooses among them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from autoprec.precision import PRECISION_NAMES, parse_precision

#: Default fraction of dense peak reached by a layer's matrix work. Round figures, not
#: measurements: large GEMMs reach ~70-90% of peak in NVIDIA's cuBLAS/matmul performance guides,
#: whole training steps reach ~40-60% model-FLOPs utilisation in MLPerf Training submissions; we
#: sit between the two. fp8 is lower because real fp8 speedups over bf16 (Transformer Engine
#: material) are ~1.3-1.5x rather than 2x. nvfp4 (Blackwell's FP4 tensor cores): 0.43, a
#: measurement: the NVFP4 CUTLASS GEMM without its input quantisation reaches 3904 TFLOP/s at
#: M, N, K = 16384, 6144, 4096 (vllm-project/vllm pull request #20646, 'Basic tuned configs for
#: NVFP4 CUTLASS dense GEMM', table 'N=6144 K=4096', row 16384, column 'nvfp4-noquant'), 0.43
#: of a B200's 9000 dense; the same row's bf16 ``torch.mm`` (1360) sits at 0.60 of 2250, the
#: bf16 default above. (The GPU is not named in the excerpt read; NVFP4 GEMMs run only on
#: Blackwell and the author's neighbouring SM100 pull requests, e.g. #18778, measure a B200.)
#: mxfp8 runs at fp8's rate and efficiency (no default of its own). Calibrate on the target for
#: real numbers.
DEFAULT_COMPUTE_EFFICIENCY: Mapping[str, float] = MappingProxyType(
    {"fp32": 0.7, "tf32": 0.6, "bf16": 0.6, "fp16": 0.6, "fp8": 0.5, "nvfp4": 0.43}
)


#: The forward GEMM of torchao's rowwise recipes (``_scaled_mm`` with per-row scales, fast
#: accumulation) relative to the tensorwise fp8 GEMM's rate: "Most shapes are within 90-100% of
#: tensor-wise efficiency, but there's a long tail going down to 50%" (pytorch/pytorch#147971,
#: the CUTLASS rowwise kernel on H100); the lower end of "most shapes". Their backward GEMMs
#: run the tensorwise kernel with unit scales and rescale the result afterwards (torchao's
#: ``addmm_float8_unwrapped``), which the cost model charges as a memory pass instead.
ROWWISE_GEMM_EFFICIENCY = 0.9

#: An fp8 GEMM with 1x128 / 128x128 block scales (``fp8_block``: torchao's
#: ``blockwise_fp8_training``, Transformer Engine's ``Float8BlockScaling``) relative to the fp8
#: rate: Transformer Engine's GEMM profiling table (docs/features/low_precision_training/
#: gemm_profiling/gemm_profiling.rst at 33294178, B300, autocast mode, forward) times FP8Block
#: against MXFP8 at the same shapes: 'QKV Proj' 0.611 ms against 0.544 ms (0.890) and 'MLP Up'
#: 0.906 ms against 0.873 ms (0.964); their geometric mean, 0.93. MXFP8 is priced at the plain
#: fp8 rate, so this is the block-scaled GEMM's rate over fp8's. (Both sides of that table
#: include quantising the inputs, alike in bytes for the two formats.)
BLOCK_FP8_GEMM_EFFICIENCY = 0.93


#: The fraction of the element-wise and normalisation traffic that a ``torch.compile``'d step
#: keeps (:attr:`Efficiency.fused_elementwise`). A round figure, not a measurement: Inductor
#: fuses each chain of element-wise operations (a norm, its scale, an activation, a residual
#: add) into one kernel that reads the chain's inputs once and writes its outputs once, which
#: for the chains of a transformer block or a ResNet's batch norm, ReLU and add removes about
#: half of the reads and writes the operations make one by one. A calibration from measured
#: compiled steps replaces it (``autoprec hardware calibrate --from``).
DEFAULT_FUSED_ELEMENTWISE = 0.5

#: The fields of :class:`Efficiency`, as its files name them.
EFFICIENCY_FIELDS = (
    "compute",
    "bandwidth",
    "kernel_overhead_s",
    "conv_compute",
    "fused_elementwise",
)


class CostModelError(ValueError):
    """The cost model cannot estimate this device, precision or setting."""


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak actually reached.

    Args:
        compute: achieved / dense peak FLOP/s per precision; precisions not given take
            :data:`DEFAULT_COMPUTE_EFFICIENCY`.
        bandwidth: achieved / peak memory bandwidth (0.8: STREAM-like copies reach ~80-90% of
            HBM peak).
        kernel_overhead_s: fixed launch and dispatch cost per kernel (~5 us for a CUDA launch
            plus PyTorch dispatch); eager programs pay it per operation, compiled ones per
            fused kernel.
        conv_compute: achieved / dense peak of convolutions per precision, where they differ
            from ``compute``'s matrix multiplications (cuDNN's kernels for a ResNet's many
            small convolutions reach less of the peak than a large GEMM); a precision left
            out takes ``compute``'s factor. Empty by default: only a calibration sets it.
        fused_elementwise: the fraction of the element-wise and normalisation traffic (bytes
            and kernels) a compiled program keeps (``torch.compile`` fuses chains of
            element-wise operations into one kernel that reads the chain's inputs and writes
            its outputs): :data:`DEFAULT_FUSED_ELEMENTWISE` unless calibrated.
    """

    compute: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_COMPUTE_EFFICIENCY))
    bandwidth: float = 0.8
    kernel_overhead_s: float = 5e-6
    conv_compute: Mapping[str, float] = field(default_factory=dict)
    fused_elementwise: float = DEFAULT_FUSED_ELEMENTWISE

    def __post_init__(self) -> None:
        merged = dict(DEFAULT_COMPUTE_EFFICIENCY)
        for key, value in dict(self.compute).items():
            merged[parse_precision(key).value] = _fraction(value, f"efficiency.compute.{key}")
        object.__setattr__(self, "compute", merged)
        conv = {
            parse_precision(key).value: _fraction(value, f"efficiency.conv_compute.{key}")
            for key, value in dict(self.conv_compute).items()
        }
        object.__setattr__(self, "conv_compute", conv)
        object.__setattr__(self, "bandwidth", _fraction(self.bandwidth, "efficiency.bandwidth"))
        fused = _fraction(self.fused_elementwise, "efficiency.fused_elementwise")
        object.__setattr__(self, "fused_elementwise", fused)
        overhead = self.kernel_overhead_s
        if not _is_number(overhead) or not math.isfinite(overhead) or overhead < 0:
            raise CostModelError(f"efficiency.kernel_overhead_s must be >= 0, got {overhead!r}")

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self.to_dict().items())))

    def conv(self, precision: str) -> float:
        """The efficiency of a convolution at ``precision`` (``conv_compute``, else
        ``compute``'s)."""
        return self.conv_compute.get(precision, self.compute[precision])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; ``conv_compute`` and ``fused_elementwise`` only where they differ
        from their defaults, so that the canonical form (a cache key) of an efficiency made
        before they existed is unchanged."""
        out: dict[str, Any] = {
            "compute": dict(self.compute),
            "bandwidth": self.bandwidth,
            "kernel_overhead_s": self.kernel_overhead_s,
        }
        if self.conv_compute:
            out["conv_compute"] = dict(self.conv_compute)
        if self.fused_elementwise != DEFAULT_FUSED_ELEMENTWISE:
            out["fused_elementwise"] = self.fused_elementwise
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Efficiency:
        """Inverse of :meth:`to_dict` (missing fields take their defaults)."""
        return cls(**{k: data[k] for k in EFFICIENCY_FIELDS if k in data})


def fill_compute(measured: Mapping[str, float], precisions: tuple[str, ...]) -> dict[str, float]:
    """Compute efficiencies for ``precisions`` from the measured ones.

    A precision left out takes its default, scaled as its nearest wider measured precision
    sits from that one's default (see :mod:`autoprec.hardware.efficiency`).

    Args:
        measured: achieved / dense peak per measured precision.
        precisions: the precisions to fill (the device's supported ones).
    """
    out = {parse_precision(p).value: float(v) for p, v in measured.items()}
    if not out:
        return out
    for p in precisions:
        if p in out or p not in DEFAULT_COMPUTE_EFFICIENCY:  # mxfp8: fp8's rate
            continue
        wider = [q for q in reversed(PRECISION_NAMES[: PRECISION_NAMES.index(p)]) if q in out]
        wider = [q for q in wider if q in DEFAULT_COMPUTE_EFFICIENCY]
        if wider:
            out[p] = (
                DEFAULT_COMPUTE_EFFICIENCY[p] * out[wider[0]] / DEFAULT_COMPUTE_EFFICIENCY[wider[0]]
            )
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fraction(value: object, what: str) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise CostModelError(f"{what} must be a fraction of peak > 0, e.g. 0.6; got {value!r}")
    return float(value)
