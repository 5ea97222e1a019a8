"""Accelerators: the device database (dense peak rates, memory, precisions) and local detection.

Example:
    >>> from autoprec.hardware import get_device, supported_precisions
    >>> get_device("h100-sxm").peak_flops("fp8") / 1e12
    1979.0
    >>> supported_precisions("v100-sxm2-32gb")
    ('fp32', 'fp16')
"""

from __future__ import annotations

from autoprec.hardware.cost import CostModel, Efficiency, LayerCost, StepEstimate
from autoprec.hardware.database import (
    DeviceDatabaseError,
    DeviceSpec,
    PreferredMode,
    UnknownDeviceError,
    detect,
    get_device,
    list_devices,
    supported_precisions,
)
from autoprec.hardware.defaults import default_policy

__all__ = [
    "CostModel",
    "DeviceDatabaseError",
    "DeviceSpec",
    "Efficiency",
    "LayerCost",
    "PreferredMode",
    "StepEstimate",
    "UnknownDeviceError",
    "default_policy",
    "detect",
    "get_device",
    "list_devices",
    "supported_precisions",
]
