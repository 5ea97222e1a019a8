"""Efficiency factors: the fraction of a device's peak rates that a training step reaches.

Where they come from, first found first used:

1. a calibration of the device on this machine (``autoprec hardware calibrate``, stored in the
   user's cache: :func:`autoprec.hardware.calibration.load_efficiency`);
2. published measurements of the device's matmul rate per format (``matmul_tflops`` in
   ``devices.yaml``, each with its source): efficiency = measured / dense peak;
3. the documented defaults, :data:`DEFAULT_COMPUTE_EFFICIENCY`.

A format that a calibration or a published measurement leaves out takes its default, scaled by
how far the device's nearest wider measured format sits from that format's default (an H100
measured at 80% of peak on bf16 matmuls is assumed to sit as far above the fp8 default too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec.hardware.factors import (
    DEFAULT_COMPUTE_EFFICIENCY,
    CostModelError,
    Efficiency,
    fill_compute,
)

if TYPE_CHECKING:
    from autoprec.hardware.database import DeviceSpec

__all__ = [
    "DEFAULT_COMPUTE_EFFICIENCY",
    "CostModelError",
    "Efficiency",
    "default_efficiency",
    "fill_compute",
    "published_efficiency",
]


def published_efficiency(device: DeviceSpec) -> Efficiency:
    """Efficiency from the device's published matmul measurements (defaults without any)."""
    measured = {p: v / device.peak_tflops[p] for p, v in device.matmul_tflops.items()}
    return Efficiency(compute=fill_compute(measured, device.supported_precisions))


def default_efficiency(device: DeviceSpec) -> Efficiency:
    """The device's calibration if this machine has one, else :func:`published_efficiency`."""
    from autoprec.hardware.calibration import load_efficiency

    found = load_efficiency(device.name)
    return found if found is not None else published_efficiency(device)
