"""The precision rule a user gets without searching: the device's usual mixed-precision mode.

Example:
    >>> from autoprec.models import load_model
    >>> from autoprec.graph import analyze
    >>> table = analyze(load_model("resnet50", num_classes=1000), 1)
    >>> policy = default_policy(table, "a100-40gb-sxm")
    >>> policy.precision_for("conv1"), policy.precision_for("layer1.0.conv1")
    (<Precision.TF32: 'tf32'>, <Precision.BF16: 'bf16'>)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec.hardware.database import DeviceSpec, get_device
from autoprec.policy import LossScalingConfig, PrecisionPolicy, TargetInfo
from autoprec.policy.fields import loss_scaling_for
from autoprec.precision import Precision, parse_precision

if TYPE_CHECKING:
    from autoprec.graph.table import LayerTable


def _loss_scaling(spec: DeviceSpec, low: Precision) -> LossScalingConfig | None:
    needs = spec.preferred.loss_scaling or low is Precision.FP16
    return LossScalingConfig() if needs else None


def default_policy(table: LayerTable, device: DeviceSpec | str) -> PrecisionPolicy:
    """The device's default rule for the analysed model.

    Convolution, linear and attention layers run at ``device.preferred.low``; the first and
    the last layer, and every layer the table does not mark as able to go low, run at
    ``device.preferred.wide`` (tf32 or fp32), which is also the policy default. Dynamic loss
    scaling when the device's rule asks for it or the low format is fp16.

    Args:
        table: the model's layer table (:func:`autoprec.graph.analyze`).
        device: a :class:`DeviceSpec` or a name from the database.

    Returns:
        The policy, targeted at ``device`` in ``auto`` mode, provenance ``hardware-default``.
    """
    spec = get_device(device)
    low, wide = parse_precision(spec.preferred.low), parse_precision(spec.preferred.wide)
    layers = {
        row.name: low
        for row in table.rows
        if not (row.first or row.last) and row.default_precision != Precision.FP32.value
    }
    return PrecisionPolicy(
        default=wide,
        layers=layers,
        loss_scaling=_loss_scaling(spec, low),
        target=TargetInfo(device=spec.name, mode="auto"),
        provenance={"agent": "hardware-default"},
    )


def amp_policy(
    device: DeviceSpec | str, precision: str | Precision | None = None
) -> PrecisionPolicy:
    """Blanket AMP: every tunable layer at one low precision (the device's ``preferred.low``
    unless ``precision`` is given), with dynamic loss scaling for fp16.

    Raises:
        ValueError: ``precision`` is unknown or the device cannot run it.
    """
    spec = get_device(device)
    p = parse_precision(spec.preferred.low if precision is None else precision)
    if not spec.supports(p):
        raise ValueError(
            f"device {spec.name!r} cannot run {p.value}; it supports "
            f"{', '.join(spec.supported_precisions)}"
        )
    return PrecisionPolicy.uniform(
        p,
        loss_scaling=loss_scaling_for({"": p}),
        target=TargetInfo(device=spec.name, mode="auto"),
        provenance={"agent": f"amp-{p.value}"},
    )


def search_precisions(device: DeviceSpec) -> tuple[str, ...]:
    """The precisions a search offers on ``device`` without ``--precisions``: every format its
    tensor cores run (in the database's order), and fp8 block scaling where they run fp8
    (DeepSeek-V3's recipe, a format of its own: 1x128 and 128x128 blocks, like MXFP8's).
    torchao's per-tensor and rowwise fp8 recipes beyond tensorwise stay opt-in."""
    out = list(device.supported_precisions)
    if "fp8" in out:
        out.insert(out.index("fp8") + 1, Precision.FP8_BLOCK.value)
    return tuple(out)
